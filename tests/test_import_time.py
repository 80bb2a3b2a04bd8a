"""What `import qshard` and `qshard --help` import: checked by module, not by a wall clock.

`import torch` alone is about 0.8 s; torch.distributed.tensor (via sympy) adds about 0.35 s,
Triton and transformers more. qshard imports those only when a model uses them.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ["torch.distributed.tensor", "triton", "transformers", "sympy", "qshard.tp"]


def _imported_after(code: str) -> dict:
    """Run `code` in a fresh interpreter (this checkout's qshard) and return which modules it
    left imported, plus whatever `code` stored in `out`."""
    script = f"import json, sys\nout = {{}}\n{code}\nout['modules'] = sorted(sys.modules)\n"
    script += "print(json.dumps(out))"
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_import_qshard_leaves_distributed_triton_and_transformers_alone():
    out = _imported_after("import qshard\nout['file'] = qshard.__file__")
    assert out["file"].startswith(str(ROOT)), out["file"]
    loaded = set(out["modules"])
    assert "torch" in loaded and "qshard.layouts" in loaded  # the library itself is ready
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    assert not [m for m in loaded if m.startswith("qshard.kernels.") and "triton" in m]


def test_help_and_usage_errors_do_not_import_torch():
    code = (
        "import contextlib, io, qshard_cli\n"
        "with contextlib.redirect_stderr(io.StringIO()) as err:\n"
        "    out['status'] = qshard_cli.main(['bench', '--ms', 'zero'])\n"
        "out['error'] = err.getvalue()\n"
        "with contextlib.redirect_stdout(io.StringIO()) as text:\n"
        "    try:\n"
        "        qshard_cli.main(['--help'])\n"
        "    except SystemExit as e:\n"
        "        out['help_status'] = e.code\n"
        "out['help'] = text.getvalue()\n"
    )
    out = _imported_after(code)
    assert out["status"] == 2 and "--ms" in out["error"], out
    assert out["help_status"] == 0 and "quantize" in out["help"], out
    assert "torch" not in out["modules"] and "qshard" not in out["modules"]


def test_qshard_tp_loads_on_first_use_and_dtensor_gets_the_cache_key_fix():
    # The fix must be in place whichever comes first: qshard, or torch.distributed.tensor.
    # A probe of the module's spec first (importlib.util.find_spec) must not use the hook up.
    for code in (
        "import qshard\nimport torch.distributed.tensor as t",
        "import torch.distributed.tensor as t\nimport qshard",
        "import qshard, importlib.util\nimportlib.util.find_spec('torch.distributed.tensor')"
        "\nimport torch.distributed.tensor as t",
    ):
        code += (
            "\nout['patched'] = getattr(t.DTensor._stable_hash_for_caching, 'qshard_patched', 0)"
            "\nout['tp'] = qshard.tp.parallelize.__module__"
        )
        out = _imported_after(code)
        assert out["patched"] is True and out["tp"] == "qshard.tp.plan", (code, out)

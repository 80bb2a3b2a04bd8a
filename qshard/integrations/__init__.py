"""qshard inside other libraries, through their public extension points.

transformers.py   quant_method "qshard": a QuantizationConfigMixin and an HfQuantizer registered
                  with transformers' registration API, so that `save_pretrained` and
                  `from_pretrained` handle qshard models. Imported (and registered) by
                  `import qshard` only once transformers loads its quantizers.
"""

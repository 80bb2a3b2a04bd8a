"""The QTensor base class and the shape ops every layout shares."""

from . import grouped as _grouped  # noqa: F401  (registers the experts matmuls on QTensor)
from . import ops as _ops  # noqa: F401  (registers the shared ops on QTensor)
from .base import WHOLE, DeviceForm, QTensor, spans_dim, stored_nbytes
from .validation import FLOAT_DTYPES

__all__ = ["FLOAT_DTYPES", "WHOLE", "DeviceForm", "QTensor", "spans_dim", "stored_nbytes"]

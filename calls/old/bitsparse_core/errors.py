"""Every error bitsparse_core raises, one class per rule.

Two families:

* :class:`FormatError` -- a serialized buffer breaks a rule of ``docs/format.md``.
  Each validation rule of the spec (its section "Validation") names exactly one
  subclass here, so a caller can tell *which* rule a corrupted buffer broke.
* :class:`InputError` -- a caller handed ``pack``/``unpack`` something they cannot
  take (dtype, layout, device, capacity, encoding).

Both derive from :class:`BitsparseError`; they also derive from the builtin the
situation matches (``ValueError``, ``TypeError``) so generic handlers still work.
"""

from __future__ import annotations


class BitsparseError(Exception):
    """Base class of every bitsparse_core error."""


# --------------------------------------------------------------------------- #
# Serialized-buffer validation (docs/format.md §8, rules V1..V19)             #
# --------------------------------------------------------------------------- #
class FormatError(BitsparseError, ValueError):
    """A serialized buffer is not a valid format-v1 buffer."""


class TruncatedBufferError(FormatError):
    """V1a / V1b / V1c: the buffer is shorter than the 120-byte fixed header (V1a), than
    its checked ``header_size`` (V1b, after V8) or than its checked ``total_size``
    (V1c, after V12)."""


class BadMagicError(FormatError):
    """V2: the first four bytes are not the magic ``b"BSPK"``."""


class UnsupportedVersionError(FormatError):
    """V3: the format version is not one this library reads."""


class UnknownDTypeError(FormatError):
    """V4: the (DLPack code, bits) pair is not one of the five dtypes of the spec."""


class UnknownEncodingError(FormatError):
    """V5: the encoding byte is not 0 (raw), 1 (nosign) or 2 (signplane)."""


class ChunkSizeError(FormatError):
    """V6: chunk_log2 is outside the allowed range."""


class ReservedFieldError(FormatError):
    """V7: a reserved header field is not zero."""


class HeaderSizeError(FormatError):
    """V8: ndim exceeds the maximum or header_size disagrees with ndim."""


class ShapeTooLargeError(FormatError):
    """V19: the product of the shape's nonzero dimensions exceeds 2**58 (checked before V9)."""


class ShapeMismatchError(FormatError):
    """V9: numel differs from the product of the shape."""


class OffsetWidthError(FormatError):
    """V10: offset_width is not the width the spec fixes for this numel."""


class CapacityError(FormatError):
    """V11: nnz exceeds capacity, or capacity exceeds numel. Also raised by ``pack`` for
    a capacity that is not an int in [0, numel] (bool, float and str included)."""


class SectionLayoutError(FormatError):
    """V12: a section offset/length or total_size disagrees with the size formula."""


class TrailingBytesError(FormatError):
    """V13: the buffer is longer than total_size."""


class ChecksumError(FormatError):
    """V14: the CRC-32 stored in the header does not match the buffer."""


class NonzeroPaddingError(FormatError):
    """V15: a padding byte or padding bit is not zero."""


class MaskCountError(FormatError):
    """V16: the number of set bits in the mask differs from nnz."""


class ChunkOffsetsError(FormatError):
    """V17: the chunk-offset table is not the running count of set mask bits."""


class ZeroValueError(FormatError):
    """V18: a stored value has the all-zero bit pattern (it should not be stored)."""


# --------------------------------------------------------------------------- #
# Caller errors                                                               #
# --------------------------------------------------------------------------- #
class InputError(BitsparseError):
    """A caller passed something pack/unpack cannot take."""


class UnsupportedDTypeError(InputError, TypeError):
    """The tensor's dtype is not bf16, fp16, fp32, fp8 e4m3fn or fp8 e5m2."""


class NonContiguousError(InputError, ValueError):
    """The tensor is not C-contiguous (bitsparse_core never copies silently)."""


class UnsupportedDeviceError(InputError, ValueError):
    """No backend can run on the tensor's device, or devices of two arguments differ."""


class BackendUnavailableError(InputError, RuntimeError):
    """The requested backend is unknown or its dependencies are missing."""


class EncodingError(InputError, ValueError):
    """The requested encoding cannot represent the data (e.g. nosign with a set sign bit)."""


class CapacityOverflowError(InputError, OverflowError):
    """A fixed-capacity pack held more nonzeros than the capacity; the rest were dropped."""


class NotSerializableError(InputError, ValueError):
    """The tensor is in-memory only (e.g. a masked_pack companion sharing another mask)."""


class OutputMismatchError(InputError, ValueError):
    """An ``out=`` array has the wrong shape, dtype, device or layout."""


class SavedTensorModifiedError(InputError, RuntimeError):
    """A tensor saved for backward was modified in place before backward read it, and no
    exact copy of it was kept (as PyTorch refuses such a backward)."""


class UnsupportedTransformError(InputError, NotImplementedError):
    """A function transform (e.g. ``torch.func.vmap``) the packed ops cannot run under."""


# --------------------------------------------------------------------------- #
# Device errors                                                               #
# --------------------------------------------------------------------------- #
class CudaDriverError(BitsparseError, RuntimeError):
    """A CUDA driver call made by a GPU backend failed (its CUresult is in the message)."""


__all__ = [name for name, obj in dict(globals()).items()
           if isinstance(obj, type) and issubclass(obj, BitsparseError)]

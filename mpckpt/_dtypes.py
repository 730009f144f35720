"""Which torch dtypes mpckpt stores, and as what safetensors dtype.

Most dtypes map one to one. Complex dtypes without a safetensors code (complex128,
complex32) are stored through ``torch.view_as_real`` as their real component type with a
trailing dimension of 2, so any safetensors reader still sees meaningful numbers; the
skeleton records the original dtype so mpckpt gives back the complex tensor.
"""

from __future__ import annotations

import torch

_DIRECT: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.complex64: "C64",
}
for _name, _code in (
    ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("float8_e8m0fnu", "F8_E8M0"),
):
    if hasattr(torch, _name):
        _DIRECT[getattr(torch, _name)] = _code

_VIA_REAL: dict[torch.dtype, torch.dtype] = {torch.complex128: torch.float64, torch.complex32: torch.float16}

_BY_NAME: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in [*_DIRECT, *_VIA_REAL]}
_FROM_CODE: dict[str, torch.dtype] = {code: d for d, code in _DIRECT.items()}


def is_supported(dtype: torch.dtype) -> bool:
    return dtype in _DIRECT or dtype in _VIA_REAL


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}") from None


def storage_view(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The tensor as it is written (a view, never a copy) and its safetensors dtype code."""
    if t.dtype in _DIRECT:
        return t, _DIRECT[t.dtype]
    real = _VIA_REAL[t.dtype]
    return torch.view_as_real(t), _DIRECT[real]


def stored_dtype(code: str) -> torch.dtype:
    return _FROM_CODE[code]


def from_stored(t: torch.Tensor, original: torch.dtype) -> torch.Tensor:
    """Undo ``storage_view``: a tensor of ``original`` dtype over the same memory."""
    if original in _VIA_REAL:
        return torch.view_as_complex(t) if original != torch.complex32 else t.view(torch.complex32).squeeze(-1)
    return t

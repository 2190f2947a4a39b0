"""Every dtype table in one place: what a capture may be stored as, and the safetensors names.

Names are torch's (`str(tensor.dtype)` without `torch.`); the worker turns a name into a torch
dtype with `getattr(torch, name)`, so no table of torch objects is needed.
"""

from __future__ import annotations

from typing import Literal, get_args

CaptureDtype = Literal["float32", "float16", "bfloat16"]
CAPTURE_DTYPES: tuple[str, ...] = get_args(CaptureDtype)

# dtype name -> (safetensors code, bytes per element)
_TABLE = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}
ITEM_BYTES: dict[str, int] = {name: size for name, (_, size) in _TABLE.items()}
SAFETENSORS_CODE: dict[str, str] = {name: code for name, (code, _) in _TABLE.items()}
CODE_BYTES: dict[str, int] = {code: size for code, size in _TABLE.values()}

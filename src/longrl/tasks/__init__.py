"""Built-in tasks: procedurally generated prompt datasets with their reward functions (``task:NAME``)."""

from .arithmetic import make_arithmetic_rows, make_arithmetic_sft_rows
from .shapes import make_shape_rows, make_shape_sft_rows
from .tools import make_lookup_rows

TASKS = {"arithmetic": make_arithmetic_rows, "arithmetic_sft": make_arithmetic_sft_rows, "lookup": make_lookup_rows,
         "shapes": make_shape_rows, "shapes_sft": make_shape_sft_rows}

__all__ = ["TASKS", "make_arithmetic_rows", "make_arithmetic_sft_rows", "make_lookup_rows", "make_shape_rows",
           "make_shape_sft_rows"]

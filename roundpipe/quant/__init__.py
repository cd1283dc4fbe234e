"""roundpipe.quant: frozen 4-bit (NF4/FP4) weights in bitsandbytes' format.

format      the layout, code tables and Quant4State
reference   quantize/dequantize in PyTorch (CPU backend, bitwise equal to bitsandbytes' CPU backend)
"""
from .format import QUANT_TYPES, Quant4State, code_table, dynamic_map, packed_nbytes
from .reference import dequantize_4bit_ref, quantize_4bit

__all__ = ["QUANT_TYPES", "Quant4State", "code_table", "dynamic_map", "packed_nbytes", "quantize_4bit",
           "dequantize_4bit_ref"]

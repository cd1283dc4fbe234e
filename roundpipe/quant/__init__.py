"""roundpipe.quant: frozen 4-bit (NF4/FP4) weights in bitsandbytes' format.

format      the layout, code tables, Quant4State, packed_nbytes
reference   quantize/dequantize in PyTorch (the CPU backend; bitwise equal to bitsandbytes' CPU backend)
functional  dequantize with a backend per device (CUDA: the Triton kernel in roundpipe.kernels.dequant4)
linear      QuantLinear, the frozen 4-bit Linear (dequantizes on the worker: per product, or once per stage run)
experts     QuantExperts, fused MoE expert tensors [E, ., .] 4-bit per expert (transformers 5's experts modules)
keep        DequantKeep: a stage run's dequantized weights, made once and kept until the stage releases
bnb         from / to bitsandbytes Params4bit, Linear4bit and 4-bit checkpoint tensors
convert     whole-model replacement (quantize_model, convert_bnb_model)
"""
from .bnb import from_bnb, state_from_state_dict, to_state_dict
from .convert import convert_bnb_model, quantize_model
from .experts import QuantExperts, quantize_experts
from .format import QUANT_TYPES, Quant4State, code_table, dynamic_map, packed_nbytes
from .functional import dequantize
from .keep import DequantKeep
from .linear import QuantLinear, quant_linear
from .reference import dequantize_4bit_ref, quantize_4bit

__all__ = ["QUANT_TYPES", "DequantKeep", "Quant4State", "QuantExperts", "QuantLinear", "code_table",
           "convert_bnb_model", "dequantize", "dequantize_4bit_ref", "dynamic_map", "from_bnb", "packed_nbytes", "quant_linear", "quantize_4bit",
           "quantize_experts", "quantize_model", "state_from_state_dict", "to_state_dict"]

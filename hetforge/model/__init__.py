from hetforge.model.gpt_neox import GPTNeoX
from hetforge.model.presets import PRESETS, count_parameters

__all__ = ["GPTNeoX", "PRESETS", "count_parameters"]

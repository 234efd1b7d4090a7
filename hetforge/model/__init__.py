from hetforge.model.accounting import count_parameters
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig
from hetforge.model.presets import PRESETS

__all__ = ["GPTNeoX", "GPTNeoXConfig", "PRESETS", "count_parameters"]

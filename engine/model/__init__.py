from engine.model.qwen2 import Qwen2Model

__all__ = ["Qwen2Model"]

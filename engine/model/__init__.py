from engine.model.decoder import DecoderModel

__all__ = ["DecoderModel"]

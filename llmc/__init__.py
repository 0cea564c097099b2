"""llmc: an ahead-of-time compile toolchain for LLM inference."""

__version__ = "0.1.0"

"""rackserve: serving DeepSeek-V4-class Mixture-of-Experts models, from one CPU to a rack."""

__version__ = "0.1.0"

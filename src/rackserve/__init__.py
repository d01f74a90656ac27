"""rackserve: serving DeepSeek-V4-class Mixture-of-Experts models, from one CPU to a rack."""

__version__ = "0.1.0"

from rackserve.request import SamplingParams


def __getattr__(name: str):
    # `LLM` pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from rackserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]

"""meshserve: serve large language models beyond one device."""
from meshserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; keep `import meshserve` (and the CLI's --help) light.
    if name == "LLM":
        from meshserve.llm import LLM
        return LLM
    raise AttributeError(name)

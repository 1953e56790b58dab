"""Files shipped in the package: the tiny tokenizer of ``kvroute.replica.tiny_model`` (the emulated
replicas' default, the demo's and the tests'), so an installed wheel needs no checkout."""

from pathlib import Path

TINY_TOKENIZER = Path(__file__).resolve().parent / "tiny-tokenizer"

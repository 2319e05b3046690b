"""The package's vocabulary, imported by every layer above: the options (`config`), the token layout
(`layout`, `batch`), argument checks (`checks`), the forward pass's flags (`flags`) and the output type
(`output`). Imports nothing else of the package."""

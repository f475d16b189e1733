"""compress: a quantization and compression workbench for Hugging Face causal LMs."""
__version__ = "0.1.0"

import os as _os

# PyTorch's CPU allocator puts tensors of 2 MiB and more in transparent huge pages when
# this is set: a fresh 180 MB tensor then costs ~60 ms of page faults instead of ~400 ms
# on these machines (every block a stage reads, every temporary of a quantizer). Set
# THP_MEM_ALLOC_ENABLE=0 to turn it off.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

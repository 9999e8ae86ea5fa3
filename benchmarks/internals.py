"""The facade's private modules that the benchmarks and the device check reach into, in one place.

The host-side profile patches the crossing's, the cores' and the gradient reader's functions to time them,
the whole-iteration floors call the same import and multiply the facade uses, and the device
check names the crossing in use and the facade's graph-break reason. When the facade's engine
moves, this is the one import to follow.
"""

from torch_facade.amp import _host_side as host_side
from torch_facade.amp._engine import _carry as carry
from torch_facade.amp._engine import _cores as cores
from torch_facade.amp._engine import _crossing_cuda as crossing_cuda
from torch_facade.amp._engine import _dlpack as dlpack
from torch_facade.amp._engine import _gradients as gradients

__all__ = ["carry", "cores", "crossing_cuda", "dlpack", "gradients", "host_side"]

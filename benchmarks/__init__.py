"""Side-by-side speed measurements of the loss scalers (``make bench``).

One process measures, with the variants interleaved round by round (sections of ``--sections``):

1. ``whole``: whole iterations of the documented loop on a GPT-2-like model (forward, backward,
   the scaler's calls, ``optimizer.step()``, ``optimizer.zero_grad()`` with torch's default and
   with ``set_to_none=False``): the facade against ``torch.amp.GradScaler("cpu")`` and a loop
   without a scaler, for SGD(foreach), SGD(fused) and AdamW(fused), without and with clipping
   (:mod:`workbench.whole_loop`). The headline table;
2. ``scaler``: the scalers alone, on the gradients of one backward pass copied back into
   ``.grad`` before every step (:mod:`benchmarks.torch_bench`), with the machine's streaming rate
   and what fraction of that floor each scaler reaches (:mod:`benchmarks.bandwidth`);
3. ``ddp``: whole iterations under ``DistributedDataParallel``, 2 ranks on the CPU
   (:mod:`benchmarks.ddp_bench`, two spawned processes);
4. ``jax``: a jitted optax AdamW step alone and loss-scaled through ``amp_core``
   (:mod:`benchmarks.jax_bench`);
5. ``host``: the host cost per gradient tensor, on 148 and 1,000 one-element gradients with
   nothing to compute (:mod:`benchmarks.host_bench`; :mod:`benchmarks.host_profile` breaks the
   facade's share down);

6. ``startup``: import time and the first iterations, in fresh processes
   (:mod:`benchmarks.startup_bench`);
7. ``cbfloat16``: the cbfloat16 preview against float32 on a GPT-2, alternating single
   iterations and in blocks, with the page faults of each (:mod:`benchmarks.cbfloat16_bench`);
8. ``memory``: the peak resident set of whole iterations, one fresh process per variant
   (:mod:`benchmarks.memory_bench`);

and the compile time of the first step and the compilations after warm-up. Sizes:
:mod:`workbench.sizes`. Results: a markdown report on the terminal and in
``bench_output/bench.md``, every raw number in ``bench_output/bench.json``.

The device check (``python -m device_check``, ``make device-check``) is separate: see
:mod:`device_check`.
"""

from benchmarks.cli import main
from benchmarks.runner import BenchOptions, run

__all__ = ["BenchOptions", "main", "run"]

"""The engine under ``cstorch.amp``: how one iteration's overflow decision is taken.

Nothing here is public API: the public modules one level up (``grad_scaler``,
``optimizer_step``, ``casting``, ``cbfloat16``, ``conditional_update``, ``diagnostics``) call
it, and it never imports them. A decision goes one way through it:

1. read: :mod:`._gradients` collects the participating gradients where torch keeps them
   (:mod:`._storage`: flat buffers and packed small gradients; :mod:`._dtensor`: FSDP2 shards;
   :mod:`._discovery`: the parameters a loss reaches);
2. resolve the device once: :func:`._bridge.crossing_for` starts JAX as a guest on torch's device
   (:mod:`._jax_guest`) and picks that device's crossing (:mod:`._crossing`, one module per
   device kind: :mod:`._crossing_cpu`, :mod:`._crossing_cuda`, :mod:`._crossing_public`);
3. cross: the route imports the gradients into JAX, zero-copy (DLPack);
4. decide: one jitted ``amp_core`` call (:mod:`._bridge`'s cores, compiled once per gradient
   structure and kept on disk by :mod:`._core_cache`; in a distributed job the local half, one
   all-gather by :mod:`._distributed`, and the finish);
5. cross back: the route exports the result (:class:`._bridge.Carry`: the next state and the
   step's scalars) to torch, and :class:`._decision.Decision` hands out the multipliers
   (:mod:`._fused`: to fused optimizers' kernels).
"""

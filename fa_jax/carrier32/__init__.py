"""The float32 carrier behind :mod:`fa_jax.ops`: every emulated operation computed
on float32 arrays with no 64-bit type in the program (TPUs, consumer GPUs, or by
choice: ``Policy.carrier``), each result the correctly rounded one ops gives on
float64.

* :mod:`~fa_jax.carrier32.elementwise`: cast, add, mul, fma, div, max, and the
  float32 bit fields and integer steps the others build on (TwoSum, unpacking,
  rounding a value given as parts, a scan that accepts zero steps);
* :mod:`~fa_jax.carrier32.exp`, :mod:`~fa_jax.carrier32.lse`: exp/exp2 and
  attention's log-sum-exp m + log l, correctly rounded;
* :mod:`~fa_jax.carrier32.sums`: sums and matmuls under every accumulation model,
  an int32-limb accumulator; :mod:`~fa_jax.carrier32.slices` the exact dots of
  digit slices (its fast path);
* :mod:`~fa_jax.carrier32.native`: sequential FP32 matmuls on the float32 adder
  where checks on the operands prove it exact.
"""

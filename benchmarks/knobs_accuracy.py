"""Sim vs real tensor peaks for the issue-9 knobs (HSDP, op-level checkpointing) on 4 gloo ranks.

Run from the repository root: python benchmarks/knobs_accuracy.py  (about 90 s on 2 cores)
"""
from tests.test_sim_accuracy import measure_and_predict
from tests.test_sim_accuracy_knobs import MATRIX, _spec

specs, measured, predicted = measure_and_predict([_spec(*row) for row in MATRIX])
print(f"{'configuration':<36} {'measured (gloo)':>16} {'predicted (sim)':>16} {'error':>8}")
for row, spec, real, sim in zip(MATRIX, specs, measured, predicted):
    m, p = real.extras["tensor_peak_bytes"], sim.extras["tensor_peak_bytes"]
    print(f"{row[0] + ' ' + spec.train.label():<36} {m:>16,} {p:>16,} {(p - m) / m:>+8.4%}")

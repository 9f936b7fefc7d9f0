"""The pure layer: what a call looks like, what a cluster measured, what each algorithm costs.

Plain Python, NumPy and PyYAML (scikit-learn only to fit a learned model);
nothing here imports torch or needs a process group, so profiles, policies
and predictions can be read, checked and tested anywhere.

=================  ==========================================================
module             contract
=================  ==========================================================
``features``       :class:`Features` of one call (size, density, overlap,
                   world size, dtype, row width); overlap estimation
``profile``        the profile file: primitives, measurements, fitted model
``cost_model``     the analytic model (the algorithms' schedules priced on a
                   profile's primitives) and the learned model (fitted with
                   scikit-learn, evaluated with NumPy)
``nccl``           NCCL's own tuning model (v2.21.5): each collective's time on
                   a topology of nodes, GPUs per node and network, from the
                   constants in ``profiles/nccl-tuning.yaml``
``policy``         YAML policy files: rules that pin algorithms and knobs
``files``          atomic writes of every file colltune writes
``yamlsafe``       bounded safe YAML loading
=================  ==========================================================
"""

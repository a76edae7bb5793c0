"""``aegis simulate``: a discrete-event simulation of one synchronous training job under faults.

Modules: ``settings`` (durations, msgspec-decoded), ``faults`` (the fault traces and the mapping of
each root cause to what Aegis does), ``events`` (the event queue), ``core_driver`` (feeds the real
``aegis.core.machine.step``), ``recovery_costs`` (what each interruption costs per policy),
``engine`` (the timeline), ``theory`` (Young, Daly, the expected-value model and its optimum),
``search`` (the optimum found by simulation), ``report`` (the result as a dict and as text).
"""

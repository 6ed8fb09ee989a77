"""
The research wing beside the library: what scripts/ablate.py and scripts/noise.py run to compare
optimizer variants over seeds. Nothing of the model, the optimizer or the trainer imports it; it
runs scripts.base_train as processes and reads their records. Bottom up:

    stats.py     paired seeds: intervals, the detectable effect, the verdicts' words
    budget.py    how many seeds and steps of an ablation fit a wall time (--budget)
    runs.py      an ablation's runs as base_train processes, and their cache
    pacing.py    a budget followed as the runs go: the calibration kept, the seeds added
    verdicts.py  an ablation's tables, verdicts, published signs, plot and write-up
"""

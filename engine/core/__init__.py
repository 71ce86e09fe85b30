"""The step core: one step's way through the engine, a file for each part it passes.

    request.py         a request: one token list (prompt and output), its sampling params and status
    scheduler.py       each step's work: admits, allocates KV, asks the planner what to draft
                       (speculative/planner.py), calls the worker once, applies the result
    step.py            what crosses: PrefillStep / DecodeStep (slots allocated) and StepResult
    worker.py          one step's forwards: drafts, one target forward, sampling or verification
    model_runner.py    a batch into tensors, through the model (models/), logits out on the device
    graph_runner.py    the same forwards replayed from CUDA graphs (or torch.compile) at fixed shapes
    forward_batch.py, to_device.py, sampling.py, grammar.py: what the worker and runner build on
    detokenizer.py, sampling_params.py, grammar_worker.py: what a request carries
    cost_probe.py      forwards timed at start-up, which price the planner's first steps

Data flows one way: request -> scheduler -> worker -> model runner -> models; the StepResult goes back
to the scheduler, which alone changes requests.
"""

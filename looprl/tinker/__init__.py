"""A Tinker-compatible training server (`looprl serve-tinker`): the official `tinker` SDK
and tinker-cookbook recipes train and sample through looprl's trainer forward, PEFT LoRA,
AdamW and `hf` engine, on one machine. `wire.py`: the protobuf messages; `training.py`: a
training client's model; `sampling.py`: samplers; `service.py`: state, queue and futures;
`app.py`: the routes."""

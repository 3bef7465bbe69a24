"""Tools run outside the RL job: building the project's own tokenizer and models (with their curriculum),
calibrating a schedule offline, and evaluating a model on the chain task or a dataset (`sparrow model`,
`sparrow calibrate`). They use the trainer's learning code; nothing of the RL job uses them."""

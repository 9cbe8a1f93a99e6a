"""Drafter training: rollout data, the DFlash token loss and ExitTrain's exit loss, one optax step."""

"""Experiment tracking of a `sparrow up` run: TensorBoard, W&B and MLflow behind one small interface."""

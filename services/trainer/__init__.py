"""The trainer service: its gRPC face, the work feed and its Prometheus metrics (learning code lives in trainer/)."""

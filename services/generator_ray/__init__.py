"""Generators as a Ray Serve application, for clusters run with Ray (KubeRay) rather than Deployments.

Each replica runs one whole generator (the same `services.generator.main.Generator` that
`sparrow generator` runs) consuming the shared prompt stream; the number of replicas follows the
stream's consumer-group lag through `autoscale.QueueLagPolicy`. Config: deploy/ray/serve_app.yaml.
"""

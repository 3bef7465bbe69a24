"""Generators as a Ray Serve application, for clusters run with Ray (KubeRay) rather than Deployments.

Each replica runs one whole generator (the same `services.generator.main.Generator` that
`sparrow generator` runs) consuming the shared prompt stream; the number of replicas follows the
stream's outstanding groups (lag + pending) through `autoscale.OutstandingGroupsPolicy`.
Config: deploy/ray/serve_app.yaml.
"""

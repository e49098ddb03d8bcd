"""The REST API and the OpenAI-compatible /v1 endpoints: input checks, serializers and views.
Lists are read through scheduling.selectors; every change to the books goes through scheduling.services."""

"""The pytest plugin that gives a test session real PostgreSQL and Redis (embedded unless
DATABASE_URL and REDIS_URL are set); it runs before pytest-django reads the settings."""

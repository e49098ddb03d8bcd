"""What faces people in a browser, beside the REST API (scheduling.api): the dashboard (its page,
its fragments and its controls) and the admin's actions. Reads through scheduling.selectors and
changes the state only through scheduling.services. The admin itself is scheduling.admin, where
Django looks for it."""

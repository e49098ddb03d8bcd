"""How the REST API pages its lists: what a page holds unless asked, and the most one may hold.
Django-free: the API's pagination and the command line both read it."""

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000

import logging
import os

from django.conf import settings
from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuportal.settings")
application = get_wsgi_application()

if settings.SECRET_KEY == settings.PUBLIC_SECRET_KEY and not settings.DEBUG:
    # Said where an operator looks (the web's log): `up` keeps a key of its own, a deployment sets one.
    logging.getLogger("gpuportal").warning(
        "SECRET_KEY is the public default: anyone can forge sessions; set GPUPORTAL_SECRET_KEY"
    )

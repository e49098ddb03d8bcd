import os
import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = (
        "Make sure a staff superuser exists (GPUPORTAL_ADMIN_USER, default admin). Its password is "
        "GPUPORTAL_ADMIN_PASSWORD when set; otherwise one is generated and printed once, at creation."
    )

    def handle(self, *args, **options):
        username = os.environ.get("GPUPORTAL_ADMIN_USER") or "admin"
        password = os.environ.get("GPUPORTAL_ADMIN_PASSWORD") or None
        User = get_user_model()
        user = User.objects.filter(username=username).first()
        if user is None:
            generated = password is None
            password = password or secrets.token_urlsafe(12)
            User.objects.create_superuser(username=username, email="", password=password)
            if generated:
                self.stdout.write(f"admin user {username!r} created with password: {password}  (shown only once)")
            else:
                self.stdout.write(f"admin user {username!r} created (password from GPUPORTAL_ADMIN_PASSWORD)")
            return
        if password is not None and not user.check_password(password):
            user.set_password(password)
            user.save(update_fields=["password"])
            self.stdout.write(f"admin user {username!r}: password set from GPUPORTAL_ADMIN_PASSWORD")
            return
        self.stdout.write(f"admin user {username!r} exists (password unchanged)")

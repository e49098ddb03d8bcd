import os
import secrets
from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from gpuportal.stackenv import write_private


class Command(BaseCommand):
    help = (
        "Make sure a staff superuser exists (GPUPORTAL_ADMIN_USER, default admin). Its password is "
        "GPUPORTAL_ADMIN_PASSWORD when set; otherwise one is generated at creation and written to "
        "GPUPORTAL_ADMIN_PASSWORD_FILE (mode 0600; `up` sets var/admin-password), or printed once."
    )

    def handle(self, *args, **options):
        username = os.environ.get("GPUPORTAL_ADMIN_USER") or "admin"
        password = os.environ.get("GPUPORTAL_ADMIN_PASSWORD") or None
        password_file = os.environ.get("GPUPORTAL_ADMIN_PASSWORD_FILE") or None
        User = get_user_model()
        user = User.objects.filter(username=username).first()
        if user is None:
            generated = password is None
            password = password or secrets.token_urlsafe(12)
            User.objects.create_superuser(username=username, email="", password=password)
            if not generated:
                self.stdout.write(f"admin user {username!r} created (password from GPUPORTAL_ADMIN_PASSWORD)")
            elif password_file:
                # Kept in a file rather than printed: a line printed once scrolls away under the
                # workers' start-up output, and the README's commands read the file.
                # Replaced whole: a file left by an earlier database's admin says nothing true now.
                write_private(Path(password_file), password + "\n")
                self.stdout.write(f"admin user {username!r} created; its password is in {password_file}")
            else:
                self.stdout.write(f"admin user {username!r} created with password: {password}  (shown only once)")
            return
        if password is not None and not user.check_password(password):
            user.set_password(password)
            user.save(update_fields=["password"])
            self.stdout.write(f"admin user {username!r}: password set from GPUPORTAL_ADMIN_PASSWORD")
            return
        self.stdout.write(f"admin user {username!r} exists (password unchanged)")

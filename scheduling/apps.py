from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        from scheduling.models import UserLimits
        from scheduling.services import user_limits

        # An edit of a user's limits (in the admin) holds at once in the process that made it.
        for signal in (post_save, post_delete):
            signal.connect(user_limits.on_row_changed, sender=UserLimits, dispatch_uid="scheduling.user_limits")

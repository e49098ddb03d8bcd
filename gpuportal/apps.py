from django.apps import AppConfig


class GpuportalConfig(AppConfig):
    name = "gpuportal"
    verbose_name = "gpuportal"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_login_failed

        from gpuportal import throttle

        # The admin's login form counts its failures like the API's token endpoint.
        user_login_failed.connect(throttle.on_login_failed, dispatch_uid="gpuportal.throttle")

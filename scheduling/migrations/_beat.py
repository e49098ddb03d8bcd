"""The two RunPython functions of a migration that adds django-celery-beat rows (what beat sends,
editable in the admin). Named with a leading underscore, so Django's loader reads it as no
migration; the test fixture `beat_schedules` finds each migration's `create_schedules`, which
these are bound to. The migrations before 0039 spell the same functions out."""

from __future__ import annotations

from collections.abc import Callable, Sequence

# (name, task, every seconds, description)
Schedule = tuple[str, str, int, str]


def schedule_functions(schedules: Sequence[Schedule]) -> tuple[Callable, Callable]:
    """(create, remove) for migrations.RunPython: each row on the `control` queue, every so many
    seconds; made once (an existing row, perhaps edited in the admin, is kept), removed by name."""

    def create_schedules(apps, schema_editor):
        IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
        PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
        for name, task, every, description in schedules:
            interval, _ = IntervalSchedule.objects.get_or_create(every=every, period="seconds")
            PeriodicTask.objects.get_or_create(
                name=name,
                defaults={"task": task, "interval": interval, "description": description, "queue": "control"},
            )

    def remove_schedules(apps, schema_editor):
        PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
        PeriodicTask.objects.filter(name__in=[name for name, *_ in schedules]).delete()

    return create_schedules, remove_schedules

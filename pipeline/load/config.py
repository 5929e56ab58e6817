"""Settings → per-pool picture configuration, validated once at start-up."""

from __future__ import annotations

from ..cost import price_table
from ..settings import Settings, SettingsError
from .picture import PictureConfig
from .profiles import build_profiles, check_assignment


class PictureConfigs:
    def __init__(self, settings: Settings) -> None:
        try:
            self.profiles = build_profiles(settings.profiles)
            check_assignment(self.profiles, settings.pool_profiles, settings.default_profile)
            self.prices = price_table(settings.gpu_prices)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        self.settings = settings
        self._cache: dict[str, PictureConfig] = {}

    def for_pool(self, pool: str) -> PictureConfig:
        config = self._cache.get(pool)
        if config is None:
            s = self.settings
            profile = self.profiles[s.pool_profiles.get(pool, s.default_profile)]
            config = self._cache[pool] = PictureConfig(
                profile, self.prices, fast_window_s=int(round(s.fast_window_s)),
                cost_window_s=int(round(s.cost_window_s)), allowed_lateness_s=s.allowed_lateness_s,
                stale_after_s=s.replica_stale_after_s)
        return config

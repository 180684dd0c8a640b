package main

import (
	"context"
	"log/slog"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
)

// served is what notifySystemd needs of the agent.
type served interface {
	Serving() <-chan struct{}
	StaleLoops(now time.Time, limit time.Duration) []string
}

// notifySystemd tells systemd that the agent is ready (Type=notify) once it serves and, if the unit sets
// WatchdogSec, notifies the watchdog every third of it while the loops the ring depends on still turn. A
// deadlocked agent stops notifying, so systemd aborts it (SIGABRT: the Go runtime writes every goroutine's
// stack to the journal) and starts it again; its jobs run on under their shims and the new agent adopts
// them. Until then its protector does not fail it over, since its host answers (docs/detection.md), and its
// jobs run unprotected. Outside systemd (no NOTIFY_SOCKET) it does nothing.
func notifySystemd(ctx context.Context, a served, log *slog.Logger) {
	select {
	case <-ctx.Done():
		return
	case <-a.Serving():
	}
	if _, err := daemon.SdNotify(false, daemon.SdNotifyReady); err != nil {
		log.Warn("could not tell systemd the agent is ready", "err", err)
	}
	every, err := daemon.SdWatchdogEnabled(false)
	if err != nil {
		log.Warn("systemd's watchdog settings are unreadable; not notifying it", "err", err)
	}
	if every <= 0 {
		return
	}
	t := time.NewTicker(every / 3)
	defer t.Stop()
	reported := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if stale := a.StaleLoops(time.Now(), every/2); len(stale) > 0 {
			if !reported {
				log.Error("loops of this agent have not run for half of systemd's WatchdogSec: not notifying the watchdog, which restarts the agent (its jobs run on and are adopted)",
					"loops", stale, "watchdog", every)
			}
			reported = true
			continue
		}
		reported = false
		if _, err := daemon.SdNotify(false, daemon.SdNotifyWatchdog); err != nil {
			log.Warn("could not notify systemd's watchdog", "err", err)
		}
	}
}

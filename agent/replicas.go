package agent

import (
	"context"

	"github.com/ftkit/ftkit/ckpt/ship"
)

// keepReplicas applies retention to the copies this protector holds of the sender's snapshots of a job,
// after one of them was received: the newest checkpoint.keep stay, as on the sender, and the newest copy
// that verifies is never deleted. The one just received counts as verified (Receive hashed it), so in
// the usual case nothing is hashed again.
func (a *Agent) keepReplicas(ctx context.Context, got *ship.Received) {
	m := got.Manifest
	deleted, err := a.store.PruneReceived(ctx, m.Job, m.Node, a.cfg.Checkpoint.Keep, m.ID)
	if err != nil {
		a.log.Warn("prune replicas", "job", m.Job, "from", m.Node, "err", err)
	}
	if len(deleted) > 0 {
		a.log.Debug("pruned replicas", "job", m.Job, "from", m.Node, "ids", deleted)
	}
}

package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"sync"

	"github.com/ftkit/ftkit/ackclamp"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/restore/recovery"
	"github.com/ftkit/ftkit/tcpflow"
)

// recoveryActions are the agent's actions a recovery (restore/recovery) uses: its snapshots, its peers,
// its log, its jobs. One serves one recovery; Run calls it for several jobs at once.
type recoveryActions struct {
	a *Agent
	// records are the job records of the fetched snapshots, which Restore runs (and whose cgroup
	// GiveBackUnlessStarted looks at).
	mu      sync.Mutex
	records map[*recovery.Job]Job
	// fenced is the failed node this recovery restores the jobs of: its coordinator made sure it was off
	// before it asked for the recovery, so an incarnation claimed by a restore there runs nowhere.
	fenced string
	// by is the member that asked for this fail-over (the claimer), told to the start-job command when a
	// job's placement names this host (admitPlacedRestore); "" for a migration (root's) or a resume.
	by string
	// unlocks end this recovery's hold on the jobs it claims (lockRestore), once it has ended (endRestores).
	unlocks map[string]func()
}

// lockRestore holds job id for this recovery (Agent.lockRestore), once per job.
func (r *recoveryActions) lockRestore(ctx context.Context, id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.unlocks[id]; ok {
		return nil
	}
	unlock, err := r.a.lockRestore(ctx, id, "a recovery")
	if err != nil {
		return err
	}
	// Fetch claimed the job's network name before this lock; the recovery makes the network after it
	// (recovery.JobNet), not through claimJobNet: a retry of a left network of that name begun meanwhile
	// ends first.
	r.a.waitLeftNetRetry()
	if r.unlocks == nil {
		r.unlocks = map[string]func(){}
	}
	r.unlocks[id] = unlock
	return nil
}

// endRestores lets the jobs this recovery held be restored here again: call it once recovery.Run has
// returned, what a failed restore undoes (its guard, its network, its claim) undone.
func (r *recoveryActions) endRestores() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, unlock := range r.unlocks {
		unlock()
		delete(r.unlocks, id)
	}
}

func (r *recoveryActions) record(j *recovery.Job) Job {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.records[j]
}

// recoveryDeps wires a recovery to this agent; track persists it, net is the host's network (nil for a
// resume: recovery.ReplayAndVerify touches no network); fenced is the failed node the recovery is for
// ("" if none: a migration, a resume).
func (a *Agent) recoveryDeps(track recovery.Tracker, net recovery.Network, fenced string) recovery.Deps {
	act := &recoveryActions{a: a, records: map[*recovery.Job]Job{}, fenced: fenced}
	d := recovery.Deps{Snapshots: act, Peers: act, Log: act, Jobs: act, Network: net, Tracker: track,
		Logger: a.log, ReplayTimeout: a.cfg.Failover.ReplayTimeout.Duration, ParallelJobs: a.cfg.Failover.ParallelRestores}
	if a.clamp != nil {
		d.Clamp = recoveryClamp{a.clamp, a.log}
	}
	if a.det.Recording() {
		d.Determinants = recoveryDeterminants{a}
	}
	return d
}

// recoveryDeterminants gives a recovery the restored jobs' receive order (intercept/record, determinants.go).
type recoveryDeterminants struct{ a *Agent }

func (r recoveryDeterminants) Since(ctx context.Context, source string, m *ckpt.Manifest, ran string) ([]intercept.Det, error) {
	return r.a.DeterminantsSince(ctx, source, m, ran)
}

func (r recoveryDeterminants) Watch(job string) (<-chan intercept.Event, func()) {
	return r.a.det.Calls(job)
}

func (r recoveryDeterminants) Positions() bool { return r.a.det.Positions() }

func (r recoveryDeterminants) Stopper(job string) intercept.Stopper {
	return r.a.det.Stopper(job, r.a.layout().cgroup(job))
}

func (r *recoveryActions) Fetch(ctx context.Context, job string, c clusterapi.Candidate) (*recovery.Job, error) {
	j, rec, err := r.a.prepareCandidate(ctx, job, c, r.by)
	if err != nil {
		return nil, err
	}
	if rec.Net != nil {
		// The same address (and so the same 4-tuples for the peers), in a namespace of this host's.
		n := *rec.Net
		n.Name = jobNetName(r.a.cfg.Name, rec.ID)
		// This host's kind, as its parent: the record's is the old host's.
		n.Kind = r.a.cfg.JobNetwork.Kind
		r.a.claimJobNet(ctx, n.Name) // recovery.JobNet creates it, not createJobNet
		spec, err := r.a.jobNetSpec(&n)
		if err != nil {
			criu.RemoveWorkDir(j.Work)
			return nil, fmt.Errorf("job network of snapshot %s: %w", j.Manifest.ID, err)
		}
		rec.Net, j.Net = &n, recovery.JobNet{Spec: spec, Routes: r.a.routeEdits}
	}
	r.mu.Lock()
	r.records[j] = rec
	r.mu.Unlock()
	return j, nil
}

// Owner waits for the members' answer about a job address: a recovery must not take a peer for a
// stranger because nobody had asked yet.
func (r *recoveryActions) Owner(ctx context.Context, addr netip.Addr) string {
	return r.a.memberByIPWait(ctx, addr)
}

func (r *recoveryActions) LogRange(ctx context.Context, owner string, req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte, error) {
	return r.a.LogRange(ctx, owner, req)
}

func (r *recoveryActions) Received(ctx context.Context, owner string, conn tcpflow.Tuple, from uint32) (*recvdigest.Received, error) {
	return r.a.receivedOf(ctx, owner, conn, from)
}

func (r *recoveryActions) Keep(p restore.Plan) (stop func()) { return r.a.keepResends(p) }

func (r *recoveryActions) WaitLogged(ctx context.Context, conn tcpflow.Tuple, from, end uint32) {
	r.a.waitLogged(ctx, conn, from, end)
}

func (r *recoveryActions) ReadRange(ctx context.Context, w io.Writer, conn tcpflow.Tuple, seq, n uint32) error {
	return r.a.loggedRange(ctx, w, conn, seq, n)
}

// SentUpTo reads a restored socket's progress from the ACK clamp or, without it, from the sender-side
// log's flow state.
func (r *recoveryActions) SentUpTo(flow tcpflow.Tuple) (uint32, bool) {
	a := r.a
	if a.clamp != nil {
		st, err := a.clamp.State(flow)
		return st.SndNxt, err == nil
	}
	if a.netlog != nil {
		st, ok, err := a.netlog.node.FlowState(flow)
		return st.SndNxt, ok && err == nil
	}
	return 0, false
}

// FinSentAt reads where a restored socket sent its FIN from the live state of the log that captured its
// re-sent bytes (logOf: the loopback capture's for a peer on this host), which keeps it after the FIN.
func (r *recoveryActions) FinSentAt(flow tcpflow.Tuple) (uint32, bool) {
	_, c, err := r.a.logOf(flow)
	if err != nil {
		return 0, false
	}
	st, ok, err := c.FlowState(flow)
	if err != nil || !ok || !st.FinSent {
		return 0, false
	}
	return st.DataEnd(), true // the FIN takes the sequence number after the last byte
}

// Claim claims the incarnation cluster-wide; a refusal means the job runs elsewhere (ErrJobAlive). An
// incarnation the members recorded for a restore on the fenced node is superseded: that restore was cut
// short by the node's failure (a spare that died while restoring a failed node's jobs), and its
// coordinator, which asks for this recovery, took the jobs over.
func (r *recoveryActions) Claim(ctx context.Context, j *recovery.Job, n uint64) (uint64, error) {
	// Before the claim, which a repeated request of the same failure wins again under the same holder: its
	// failed restore would then give back the claim, and take down the guard and network, of the first.
	if err := r.lockRestore(ctx, j.ID); err != nil {
		return n, err
	}
	err := r.a.claimIncarnation(ctx, j.ID, n, j.Holder, j.Manifest.Node)
	var refused *grant.RefusedError
	// Every refusal must be such a restore's: one member's grant to a copy on an alive host (that missed the
	// fenced restore's give-back, say) means the job runs there.
	if r.fenced != "" && errors.As(err, &refused) && refused.OnlyOn(r.fenced) {
		n = max(n, refused.Record.Incarnation) + 1
		r.a.log.Warn("the job's incarnation was claimed by a restore on the failed node this recovery is for: claiming the next one",
			"job", j.ID, "failed", r.fenced, "recorded", refused.Record, "incarnation", n)
		err = r.a.claimIncarnation(ctx, j.ID, n, j.Holder, j.Manifest.Node)
	}
	if errors.Is(err, grant.ErrConflict) {
		err = fmt.Errorf("%w: %w", ErrJobAlive, err)
	}
	return n, err
}

func (r *recoveryActions) GiveBack(ctx context.Context, j *recovery.Job) {
	r.a.giveBack(ctx, j.ID, j.Incarnation, j.Holder, nil)
}

func (r *recoveryActions) GiveBackUnlessStarted(ctx context.Context, j *recovery.Job, cause error) {
	r.a.giveBackUnlessStarted(ctx, r.record(j), j.Incarnation, j.Holder, cause)
}

func (r *recoveryActions) Restore(ctx context.Context, j *recovery.Job) error {
	rec := r.record(j)
	rec.Incarnation = j.Incarnation
	_, err := r.a.restoreJob(ctx, j.Manifest, rec, j.Work, j.BeforeRun)
	return err
}

func (r *recoveryActions) State(id string) (string, bool) {
	cur, _, _ := r.a.Job(id, 0)
	return string(cur.State), cur.State == JobRunning
}

func (r *recoveryActions) Kill(id string, why error) { r.a.killJob(id, why) }

// NetLeft records the job network a failed recovery could not delete as deleteJobNet does: the agent
// deletes it again (retryLeftNetsNow, and the next agent at its start), and its address stays held by its
// name until a deletion succeeds.
func (r *recoveryActions) NetLeft(j *recovery.Job, err error) {
	n := r.record(j).Net
	if n == nil {
		return
	}
	r.a.noteLeftNet(n.Name, leftNet{Job: j.ID, Addr: n.Addr}, true)
	r.a.holdLeftAddr(n.Name, n.Addr)
}

func (r *recoveryActions) RollsBack(id string) bool { return r.a.cutRecords().RollsBack(id) }

func (r *recoveryActions) Reprotect(ctx context.Context, ids []string) (string, error) {
	return r.a.reprotect(ctx, ids)
}

// recoveryClamp is the ACK clamp as a recovery uses it.
type recoveryClamp struct {
	c   *ackclamp.Clamp
	log *slog.Logger
}

func (c recoveryClamp) Clamp(flow tcpflow.Tuple, sndNxt uint32) error { return c.c.Clamp(flow, sndNxt) }

func (c recoveryClamp) Hold(flow tcpflow.Tuple, on bool) error { return c.c.Hold(flow, on) }

func (c recoveryClamp) PeerTSval(flow tcpflow.Tuple) (uint32, bool) {
	st, err := c.c.State(flow)
	return st.PeerTSval, err == nil && st.PeerTSval != 0
}

func (c recoveryClamp) Release(flow tcpflow.Tuple) uint64 {
	st, err := c.c.Release(flow)
	if err == nil {
		c.log.Info("ACK clamp released", "flow", flow, "snd_nxt", st.SndNxt, "peer_acks_clamped", st.Clamped, "own_acks_held_back", st.Quieted, "own_acks_lifted", st.Lifted)
	}
	return st.Clamped
}

package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/spare"
)

// Agent-to-agent traffic is package clusterapi's protocol (HTTP over the cluster's mutual TLS). This file
// wires it: the agent's server (peerService, which calls the serve* methods next to the state they touch)
// and its client (a.peers()).

// The protocol's messages the agent's own API and tests name.
type (
	PingReply       = clusterapi.PingReply
	TrimPoint       = clusterapi.TrimPoint
	LogRangeRequest = clusterapi.LogRangeRequest
	LogRangeReply   = clusterapi.LogRangeReply
	RecoverRequest  = clusterapi.RecoverRequest
	RecoverJob      = clusterapi.RecoverJob
	Candidate       = clusterapi.Candidate
	LogWatermark    = clusterapi.LogWatermark
	wireTimeouts    = clusterapi.Timeouts
)

// maxMessage bounds every message of the protocol but a recovery request.
const maxMessage = clusterapi.MaxMessage

func (a *Agent) idleTimeout() time.Duration { return a.wire.IdleTimeout() }

func (a *Agent) tlsConfig() clustertls.Config {
	return clustertls.Config{
		CAFile: a.cfg.Cluster.CA, CertFile: a.cfg.Cluster.Cert, KeyFile: a.cfg.Cluster.Key, CRLFile: a.cfg.Cluster.CRL,
		Members: func(name string) bool { _, ok := a.member(name); return ok },
		// Any operator certificate of the cluster CA (operator.go): the CA's holder issues them to people.
		Operators: func(string) bool { return true },
	}
}

// peerClient is the agent's client of the protocol, made at its first use.
type peerClient struct {
	once sync.Once
	c    *clusterapi.Client
}

// peers is the client that calls the other members (at the addresses of the current view).
func (a *Agent) peers() *clusterapi.Client {
	a.peerClient.once.Do(func() {
		a.peerClient.c = clusterapi.NewClient(clusterapi.ClientConfig{
			TLS: a.tlsConfig,
			Resolve: func(name string) (string, bool) {
				m, ok := a.member(name)
				return m.Address.String(), ok
			},
			Timeouts: a.wire,
			Logger:   a.log,
		})
	})
	return a.peerClient.c
}

// clusterServer is the protocol's server of this agent.
func (a *Agent) clusterServer(ctx context.Context) *clusterapi.Server {
	return clusterapi.NewServer(ctx, peerService{a}, clusterapi.ServerOptions{
		Timeouts: a.wire,
		// Silence beyond a few heartbeat timeouts ends a heartbeat stream.
		BeatSilence: 4 * a.cfg.Heartbeat.Timeout.Duration,
		Logger:      a.log,
		Operators:   operatorService{a},
	})
}

// serveCluster serves authenticated members on the cluster address until ctx ends or the closer is
// closed.
func (a *Agent) serveCluster(ctx context.Context) (io.Closer, error) {
	ln, err := clustertls.Listen(a.cfg.Cluster.Listen.String(), a.tlsConfig())
	if err != nil {
		return nil, err
	}
	srv := a.clusterServer(ctx).HTTPServer()
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) && ctx.Err() == nil {
			a.log.Error("cluster listener stopped", "err", err)
		}
	}()
	a.log.Info("cluster API listening", "addr", a.cfg.Cluster.Listen)
	return closerFunc(func() error {
		a.peers().Close()
		return srv.Close()
	}), nil
}

type closerFunc func() error

func (f closerFunc) Close() error { return f() }

// Ping asks member name's agent whether it is alive and which jobs it runs.
func (a *Agent) Ping(ctx context.Context, name string) (PingReply, error) {
	return a.peers().Ping(ctx, name)
}

// servePing answers with this host's name, its running jobs and their job addresses, and its available
// memory (for a migration's source to check the job fits here).
func (a *Agent) servePing() PingReply {
	rep := PingReply{Node: a.cfg.Name, Jobs: a.runningJobIDs(), JobAddrs: a.runningJobAddrs(), JobPool: a.cfg.JobNetwork.Pool}
	if n, err := spare.MemAvailable(); err == nil {
		rep.MemAvailable = &n
	} else {
		a.log.Debug("ping answered without the available memory", "err", err)
	}
	return rep
}

// The snapshots senders ask for (clusterapi.OpCheckpointNow: a log under pressure, or one that lost bytes):
// none, one being taken, or one being taken and another asked for meanwhile.
const (
	askIdle int32 = iota
	askRunning
	askQueued
)

// serveCheckpointNow snapshots this host's jobs for a sender whose log needs it. A request that
// arrives while one is being taken is not folded into it (that snapshot may have been dumped before the
// sender's bytes arrived) but queues one more, after it; further requests fold into that one, so peers
// cannot queue snapshots without bound. It reports whether it started one.
func (a *Agent) serveCheckpointNow(ctx context.Context, peer string) bool {
	for {
		switch a.asked.Load() {
		case askIdle:
			if !a.asked.CompareAndSwap(askIdle, askRunning) {
				continue
			}
			a.log.Info("snapshot requested by a sender for its log", "peer", peer)
			go a.takeAskedSnapshots(context.WithoutCancel(ctx))
			return true
		case askRunning:
			if !a.asked.CompareAndSwap(askRunning, askQueued) {
				continue
			}
			a.log.Info("snapshot requested by a sender for its log while one is being taken: another follows it", "peer", peer)
			return false
		default:
			a.log.Info("snapshot requested by a sender for its log; one is already queued", "peer", peer)
			return false
		}
	}
}

// takeAskedSnapshots takes the snapshot a sender asked for, and one more each time another was asked for
// meanwhile. Before, such a request was folded into the snapshot being taken: in ci258 a sender asked
// again once that snapshot's receive points had trimmed its log, the receiver answered with the snapshot
// it was finishing (dumped 0.5 s earlier), and the sender's log waited at its cap for a snapshot nobody
// took, until a connection timed out.
func (a *Agent) takeAskedSnapshots(ctx context.Context) {
	for {
		a.log.Debug("taking the snapshot a sender asked for")
		if _, err := a.Checkpoint(ctx, nil, 0); err != nil {
			a.log.Warn("requested snapshot failed", "err", err)
		}
		for {
			if a.asked.CompareAndSwap(askQueued, askRunning) {
				break
			}
			if a.asked.CompareAndSwap(askRunning, askIdle) {
				return
			}
		}
	}
}

// serveSnapshot stores a snapshot a member ships to this host, its protector.
func (a *Agent) serveSnapshot(ctx context.Context, peer string, c net.Conn) error {
	got, err := ship.Receive(ctx, c, a.store, ship.ReceiveOptions{Peer: peer, Authorize: ship.FromNode(peer),
		BeforeCommit: a.beforeReplicaCommit, ShareBlocks: a.cfg.Checkpoint.ShareBlocks, Logger: a.log})
	if err != nil {
		return err
	}
	a.noteReceived(got.Manifest.Job, got.Manifest.ID)
	a.keepReplicas(ctx, got)
	a.log.Info("replica stored", "peer", peer, "job", got.Manifest.Job, "snapshot", got.Manifest.ID,
		"bytes", got.Bytes, "wire_bytes", got.WireBytes, "base", got.BaseID, "copied_bytes", got.CopiedBytes,
		"shared_bytes", got.SharedBytes, "ms", got.Duration.Milliseconds())
	return nil
}

// peerService is the agent as the protocol's server: each operation calls the serve* method that does it.
type peerService struct{ a *Agent }

func (s peerService) Ping(context.Context, string) (PingReply, error) { return s.a.servePing(), nil }

func (s peerService) ReceiveSnapshot(ctx context.Context, peer string, c net.Conn) error {
	if err := s.a.serveSnapshot(ctx, peer, c); err != nil {
		return fmt.Errorf("snapshot from peer refused: %w", err)
	}
	return nil
}

func (s peerService) Fetch(ctx context.Context, peer string, req clusterapi.FetchRequest, c net.Conn) error {
	return s.a.serveFetch(ctx, c, peer, req)
}

func (s peerService) Locate(_ context.Context, _ string, req clusterapi.LocateRequest) (clusterapi.LocateReply, error) {
	return s.a.locateReply(req.ID), nil
}

func (s peerService) Trim(ctx context.Context, peer string, req clusterapi.TrimRequest) (clusterapi.TrimReply, error) {
	return s.a.serveTrim(ctx, peer, req.Points), nil
}

func (s peerService) Logged(ctx context.Context, peer string, req clusterapi.LoggedRequest) (clusterapi.LoggedReply, error) {
	return s.a.serveLogged(ctx, peer, req.Flows), nil
}

func (s peerService) LogRange(ctx context.Context, peer string, req LogRangeRequest) (LogRangeReply, func(io.Writer) error, error) {
	return s.a.serveLogRange(ctx, peer, req)
}

func (s peerService) CheckpointNow(ctx context.Context, peer string) error {
	s.a.serveCheckpointNow(ctx, peer)
	return nil
}

func (s peerService) Received(_ context.Context, _ string, req clusterapi.ReceivedRequest) (clusterapi.ReceivedReply, error) {
	return s.a.serveReceived(req)
}

func (s peerService) LogWatermark(context.Context, string) (LogWatermark, error) {
	return s.a.logWatermark()
}

func (s peerService) Determinants(_ context.Context, peer string, req clusterapi.DeterminantsRequest) error {
	return s.a.serveDeterminants(peer, req)
}

func (s peerService) DeterminantsSince(_ context.Context, _ string, req clusterapi.DeterminantsSinceRequest) (clusterapi.DeterminantsSinceReply, error) {
	return s.a.serveDeterminantsSince(req)
}

func (s peerService) Beat(_ string, b detect.Beat) {
	b = boundBeatJobs(b)
	b.Busy = boundBusy(b.Busy)
	prev, _, _ := s.a.watchdog.Last(b.From)
	// A gap past half the timeout is a near miss or a suspicion: say where it was spent, the sender's
	// scheduling or the way here, which is what an operator tunes against (docs/detection.md).
	if gap, ok := s.a.watchdog.Beat(b, time.Now()); ok {
		s.a.metrics.HeartbeatGap(gap.Arrived, gap.Sender())
		if gap.Arrived > s.a.cfg.Heartbeat.Timeout.Duration/2 {
			where := "on the way here (network, this host's kernel or agent)"
			if gap.Sender() {
				where = "on the sender (its beat was sent late)"
			}
			s.a.log.Info("heartbeat gap", "member", b.From, "arrived_after", gap.Arrived.Round(time.Millisecond),
				"sent_after", gap.Sent.Round(time.Millisecond), "missing", gap.Missing, "late", where)
		}
	}
	s.a.logUncovered(b.From, prev.Uncovered, b.Uncovered)
}

// maxBeatJobs is the most jobs of a beat a protector keeps: as many as one recovery restores
// (clusterapi.MaxRecoverJobs), so a node with more could not have them all restored anyway.
const maxBeatJobs = clusterapi.MaxRecoverJobs

// boundBeatJobs keeps of the jobs a beat names the valid names (ckpt.ValidName: a job without one has no
// replica anywhere), once each, at most maxBeatJobs, and counts the rest in Unlisted for the fail-over to
// report. A 1 MiB beat names up to ~250,000 short names: the fail-over asked every alive member about each
// of them, and beatsAgain compared them with the next beat's.
func boundBeatJobs(b detect.Beat) detect.Beat {
	if len(b.Jobs) == 0 {
		return b
	}
	seen := make(map[string]struct{}, min(len(b.Jobs), maxBeatJobs))
	var jobs []string
	for _, j := range b.Jobs {
		if _, dup := seen[j]; dup || ckpt.ValidName(j) != nil {
			continue
		}
		seen[j] = struct{}{}
		if len(jobs) == maxBeatJobs {
			b.Unlisted++
			continue
		}
		jobs = append(jobs, j)
	}
	b.Jobs = jobs
	return b
}

// maxBusy bounds what a protector keeps of a beat's Busy: it is logged at every suspicion of a busy member.
const maxBusy = 32

// boundBusy cuts a beat's Busy to maxBusy bytes (detect.BusyCheckpoint and BusyRestore are shorter): a
// longer one still says the member is busy, but up to a 1 MiB line of it went into a log line every
// heartbeat timeout while the member stayed silent.
func boundBusy(busy string) string {
	if len(busy) <= maxBusy {
		return busy
	}
	return strings.ToValidUTF8(busy[:maxBusy], "")
}

// maxUncoveredLogged bounds the lines one beat logs for the jobs it newly names uncovered; the rest are
// counted in one more. A member runs a handful of jobs, but a beat may list tens of thousands of entries.
const maxUncoveredLogged = 8

// logUncovered says which of a member's jobs its beat newly names uncovered (not in its previous beat).
// A set of the previous list keeps this linear in what the member sent: comparing every entry with every
// previous one cost ~10^9 comparisons for one 1 MiB beat, and a line per entry as many log lines.
func (a *Agent) logUncovered(member string, prev, cur []detect.Uncovered) {
	if len(cur) == 0 {
		return
	}
	before := make(map[detect.Uncovered]struct{}, len(prev))
	for _, u := range prev {
		before[u] = struct{}{}
	}
	logged, more := 0, 0
	for _, u := range cur {
		if _, ok := before[u]; ok {
			continue
		}
		if logged == maxUncoveredLogged {
			more++
			continue
		}
		logged++
		a.log.Info("a job of the member has connections its replica lacks: a failure of the member now would not restore it",
			"member", member, "job", u.Job, "replica", u.Replica)
	}
	if more > 0 {
		a.log.Info("more jobs of the member have connections their replica lacks than are logged one by one",
			"member", member, "not_logged", more)
	}
}

func (s peerService) Probe(_ context.Context, _ string, req clusterapi.ProbeRequest) (clusterapi.ProbeReply, error) {
	return s.a.serveProbe(req)
}

func (s peerService) View(_ context.Context, peer string, req clusterapi.ViewMessage) (clusterapi.ViewMessage, error) {
	return s.a.serveView(peer, req), nil
}

func (s peerService) Claim(_ context.Context, peer string, cl spare.Claim) (clusterapi.ClaimReply, error) {
	return clusterapi.ClaimReply{}, s.a.serveClaim(peer, cl)
}

func (s peerService) Replica(ctx context.Context, _ string, req clusterapi.ReplicaRequest) (clusterapi.ReplicaReply, error) {
	m, err := s.a.newestReplica(ctx, req.Job, req.Node)
	if err != nil {
		return clusterapi.ReplicaReply{}, err
	}
	return clusterapi.ReplicaReply{Manifest: m, RunSpares: s.a.runSpares(m)}, nil
}

func (s peerService) Forget(_ context.Context, peer string, req clusterapi.ForgetRequest) (clusterapi.ForgetReply, error) {
	return s.a.serveForget(peer, req)
}

func (s peerService) Recover(ctx context.Context, peer string, req RecoverRequest, progress func(clusterapi.RecoverProgress) error) error {
	return s.a.serveRecover(ctx, peer, req, progress)
}

func (s peerService) RecoveryStatus(_ context.Context, peer string, req clusterapi.RecoveryStatusRequest) (clusterapi.RecoveryStatusReply, error) {
	return s.a.serveRecoveryStatus(peer, req), nil
}

func (s peerService) Grant(_ context.Context, peer string, req clusterapi.GrantRequest) (clusterapi.GrantReply, error) {
	return s.a.localGrant(req, peer)
}

func (s peerService) Vouch(_ context.Context, peer string, req clusterapi.VouchRequest) (clusterapi.VouchReply, error) {
	return s.a.serveVouch(peer, req), nil
}

func (s peerService) Rejoin(ctx context.Context, peer string, req clusterapi.RejoinRequest) (clusterapi.ViewMessage, error) {
	return s.a.serveRejoin(ctx, peer, req)
}

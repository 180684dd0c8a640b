package agent

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"path/filepath"
	"sync"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/failurelog"
	"github.com/ftkit/ftkit/ring"
	"golang.org/x/sync/errgroup"
)

// The membership view (who is a node, who is a spare, who failed, which host holds which address) starts
// from the configuration file and then changes with failures and spare registrations. Every agent keeps
// the newest view it has seen on disk (a restarted agent finds it) and pushes a newer one to every member,
// so the views converge (ring.Newer decides between two).

const viewFile = "view.json"

type membership struct {
	mu   sync.Mutex
	view ring.View
	path string
}

func (a *Agent) loadView() error {
	a.members.path = filepath.Join(a.cfg.StateDir, viewFile)
	v, err := ring.Load(a.members.path)
	if errors.Is(err, fs.ErrNotExist) {
		var ms []ring.Member
		for _, m := range a.cfg.Cluster.Members {
			ms = append(ms, ring.Member{Name: m.Name, Address: m.Address, Role: ring.Role(m.Role), State: ring.StateAlive})
		}
		v, err = ring.New(ms)
	}
	if err != nil {
		return fmt.Errorf("membership view %s: %w (remove it to start again from the configuration)", a.members.path, err)
	}
	a.members.view = v
	return nil
}

// View returns the current membership view.
func (a *Agent) View() ring.View {
	a.members.mu.Lock()
	defer a.members.mu.Unlock()
	return a.members.view
}

// adoptView replaces the view if v is newer, saving it first. It reports whether v was adopted.
func (a *Agent) adoptView(v ring.View) (bool, error) {
	a.members.mu.Lock()
	defer a.members.mu.Unlock()
	if !ring.Newer(a.members.view, v) {
		return false, nil
	}
	if err := ring.Save(a.members.path, v); err != nil {
		return false, fmt.Errorf("save membership view: %w", err)
	}
	a.installView(v)
	return true, nil
}

// adoptPeerView is adoptView for a view another member sent, if its epoch is one a cluster can have reached
// from this host's: a member (buggy, or with an old cluster's state) must not push a view whose epoch is at
// the top of the range, after which no membership change could ever be made again, nor one far ahead.
func (a *Agent) adoptPeerView(peer string, v ring.View) (bool, error) {
	cur := a.View().Epoch
	if v.Epoch >= maxViewEpoch || v.Epoch > cur+maxEpochJump {
		return false, fmt.Errorf("view %d from %s refused: this host's is %d, and a cluster makes one view per membership change (at most %d ahead, below %d)", v.Epoch, peer, cur, maxEpochJump, uint64(maxViewEpoch))
	}
	return a.adoptView(v)
}

// Bounds of a peer's view's epoch (adoptPeerView).
const (
	maxViewEpoch = 1 << 62
	maxEpochJump = 1 << 20
)

// installView makes v, already saved, the current view (called with members.mu held), and ends the holds
// of coordinators it declares failed and the waits on recoveries whose target it declares failed.
func (a *Agent) installView(v ring.View) {
	a.log.Info("membership view changed", "epoch", v.Epoch, "ring", ringNames(v))
	a.members.view = v
	a.endHoldsOfFailed(v)
	a.targets.failed(v)
}

func ringNames(v ring.View) []string {
	var out []string
	for _, m := range v.Ring() {
		out = append(out, m.Name)
	}
	return out
}

// member is the member with this name in the current view, failed or not (its certificate stays valid:
// a failed node's agent may come back and must be able to learn that it was replaced).
func (a *Agent) member(name string) (ring.Member, bool) {
	return a.View().Member(name)
}

// incarnationOf is member name's incarnation in the current view (0 if it is not a member).
func (a *Agent) incarnationOf(name string) uint64 {
	m, _ := a.member(name)
	return m.Incarnation
}

// memberByIP is the alive cluster member that holds ip now, a host address or a job address ("" if none
// is known): it does not wait for the members' answer about a job address it does not know yet
// (holderOf; memberByIPWait does).
func (a *Agent) memberByIP(ip netip.Addr) string {
	return a.holderOf(context.Background(), ip, false, time.Now())
}

// memberByIPWait is memberByIP, waiting (within ctx) for the members' answer about a job address.
func (a *Agent) memberByIPWait(ctx context.Context, ip netip.Addr) string {
	return a.holderOf(ctx, ip, true, time.Now())
}

// ownerLookup is memberByIPWait for one batch of addresses (a snapshot's connections, a peer's trim or
// question): the members' answers from one refresh that started after the batch did serve every address
// of it none claimed, and each address is looked up once. Each such address used to start a refresh of
// its own, asking every member again: one trim of 300 unclaimed addresses pinged each member 300 times.
func (a *Agent) ownerLookup(ctx context.Context) func(netip.Addr) string {
	asked := time.Now()
	var mu sync.Mutex
	seen := map[netip.Addr]string{}
	return func(ip netip.Addr) string {
		mu.Lock()
		name, ok := seen[ip]
		mu.Unlock()
		if ok {
			return name
		}
		name = a.holderOf(ctx, ip, true, asked)
		mu.Lock()
		seen[ip] = name
		mu.Unlock()
		return name
	}
}

// protector is this host's protector in the current view.
func (a *Agent) protector() (ring.Member, bool) {
	return a.View().Protector(a.cfg.Name)
}

// serveView answers a view pushed by another agent with our own view after adopting the newer one: the
// caller learns of a newer view in the same round trip.
func (a *Agent) serveView(peer string, in viewMessage) viewMessage {
	if v, err := ring.Decode(in.View); err != nil {
		a.log.Warn("view from peer refused", "peer", peer, "err", err)
	} else if _, err := a.adoptPeerView(peer, v); err != nil {
		a.log.Error("adopt view", "err", err)
	}
	if err := a.mergeWireFailures(peer, in.Failures); err != nil {
		a.log.Warn("failure timelines from peer refused", "peer", peer, "err", err)
	}
	return a.viewMessage()
}

// viewMessage carries the view and the failure timelines ([]*Failure), so that every agent can show them.
type viewMessage = clusterapi.ViewMessage

func (a *Agent) viewMessage() viewMessage {
	b, _ := ring.Encode(a.View())
	// The newest failures that fit next to the view (which JSON carries in base64) within maxMessage go
	// along: an agent of an earlier version reads no more. A view too large for that goes alone
	// (clusterapi.MaxViewMessage).
	budget := maxMessage - base64.StdEncoding.EncodedLen(len(b)) - viewMessageOverhead
	fs := a.failures.Newest(budget)
	fb, _ := json.Marshal(fs[max(0, len(fs)-failurelog.MaxFailures):]) // no more than a peer accepts
	return viewMessage{View: b, Failures: fb}
}

// viewMessageOverhead is the bytes of a view message besides the view and the failures: field names,
// quotes, the newline, with room to spare.
const viewMessageOverhead = 256

// pushView sends the current view and failure timelines to every other alive member and adopts any newer
// view they answer with. Members that do not answer learn it later (at their next push or when they ask).
func (a *Agent) pushView(ctx context.Context) {
	a.exchangeViews(ctx, "", "view not delivered")
}

// viewFanout bounds the view exchanges an agent runs at once. Each holds the view encoded (up to
// ring.MaxEncoded, in base64) and a peer's answer as large: one exchange per member at once had an agent of
// a site of thousands of members hold gigabytes for one push.
const viewFanout = 32

// exchangeViews exchanges views with every alive member but skip, viewFanout at a time, logging why
// (what) any exchange failed.
func (a *Agent) exchangeViews(ctx context.Context, skip, what string) {
	msg := a.viewMessage()
	var g errgroup.Group
	g.SetLimit(viewFanout)
	for _, m := range a.View().Members {
		if m.Name == a.cfg.Name || m.Name == skip || m.State != ring.StateAlive {
			continue
		}
		g.Go(func() error {
			if err := a.exchangeViewMessage(ctx, m.Name, msg); err != nil {
				a.log.Debug(what, "member", m.Name, "err", err)
			}
			return nil
		})
	}
	g.Wait()
}

// exchangeView sends member name the current view and adopts any newer one it answers with.
func (a *Agent) exchangeView(ctx context.Context, name string) error {
	return a.exchangeViewMessage(ctx, name, a.viewMessage())
}

func (a *Agent) exchangeViewMessage(ctx context.Context, name string, msg viewMessage) error {
	// Seconds, and as many more as the protocol allows for a large message's size each way.
	extra := a.wire.LargeTimeout(2*(base64.StdEncoding.EncodedLen(len(msg.View))+len(msg.Failures))) - a.wire.MessageTimeout()
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second+extra)
	defer cancel()
	in, err := a.peers().View(ctx, name, msg)
	if err != nil {
		return err
	}
	v, err := ring.Decode(in.View)
	if err != nil {
		return err
	}
	if _, err := a.adoptPeerView(name, v); err != nil {
		return err
	}
	return a.mergeWireFailures(name, in.Failures)
}

// mergeWireFailures decodes the failure timelines peer sent (JSON of []*Failure; the protocol bounds
// its size) and merges them.
func (a *Agent) mergeWireFailures(peer string, b json.RawMessage) error {
	fs, err := decodeFailures(b)
	if err != nil {
		return err
	}
	return a.mergeFailures(peer, fs)
}

// decodeFailures decodes failure timelines from a peer (none if b is empty) and checks their bounds.
func decodeFailures(b json.RawMessage) ([]*Failure, error) {
	if len(b) == 0 {
		return nil, nil
	}
	var fs []*Failure
	if err := json.Unmarshal(b, &fs); err != nil {
		return nil, fmt.Errorf("failure timelines are not the expected JSON: %w", err)
	}
	return fs, checkFailures(fs)
}

// mergeFailures merges the failure timelines peer sent, refusing the whole list if it is longer than an
// agent keeps; the log keeps only those peer coordinates (failurelog.Log.Merge: the others it relays are
// not its to vouch for), clips each to its bounds and keeps the newest failurelog.MaxFailures.
//
// A recovery under way that this host did not know of is on disk before the reply: after a crash here, it
// still keeps its failed node from being admitted back mid-recovery (recoveryUnderWay). Any other merged
// update is written by saveMergedFailures, at most once every failureSaveEvery: each write is the whole log
// (up to ~11 MB, fsynced), and a member could send an update with every small message. Such an update lost
// to a crash is conservative (a timeline left unfinished is only waited on longer) and its protector sends
// it again with its next view.
func (a *Agent) mergeFailures(peer string, fs []*Failure) error {
	if err := checkFailures(fs); err != nil {
		return err
	}
	durable := false
	for _, f := range fs {
		added := f != nil && !f.Done && !a.failures.Known(f.ID)
		if a.failures.Merge(peer, f) && added {
			durable = true
		}
	}
	if durable {
		a.saveFailures()
	}
	return nil
}

// A timeline from a peer with more stages or jobs than these is malformed, not just long (the log clips
// what it keeps to failurelog.MaxStages and failurelog.MaxJobs).
const (
	maxWireStages = 128 * failurelog.MaxStages
	maxWireJobs   = 4 * failurelog.MaxJobs
)

// checkFailures refuses a list of failure timelines longer than an agent keeps, or with a timeline far
// longer than a recovery writes (the log would clip it, but such a list is malformed).
func checkFailures(fs []*Failure) error {
	if len(fs) > failurelog.MaxFailures {
		return fmt.Errorf("%d failure timelines, more than the %d an agent keeps", len(fs), failurelog.MaxFailures)
	}
	for _, f := range fs {
		if f == nil {
			continue
		}
		if len(f.Stages) > maxWireStages {
			return fmt.Errorf("failure %q has %d stages, more than a recovery writes", f.ID, len(f.Stages))
		}
		if len(f.Jobs) > maxWireJobs {
			return fmt.Errorf("failure %q lists %d jobs, more than a timeline keeps", f.ID, len(f.Jobs))
		}
	}
	return nil
}

package recovery

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/tcpflow"
)

// fake is every interface of Deps, recording what the recovery asked of it.
type fake struct {
	t *testing.T

	mu sync.Mutex
	// Snapshots: fetchErr fails a candidate snapshot; conns are the fetched manifests' connections.
	fetchErr map[string]error
	takenOn  map[string]string // the node a candidate's manifest names (default node2)
	conns    []ckpt.Conn
	connsOf  map[string][]ckpt.Conn // by job, instead of conns
	fetched  []string
	// Peers: owners of the peers' addresses.
	owners map[netip.Addr]string
	// Log: what the log holds per flow (from sequence 0), and how far each restored socket sent.
	logged map[tcpflow.Tuple][]byte
	sent   map[tcpflow.Tuple]uint32
	finAt  map[tcpflow.Tuple]uint32 // where each restored socket sent its FIN, if it did
	kept   int                      // Keep calls not yet stopped
	// Jobs.
	claimErr, restoreErr error
	finErr               error  // DeliverFIN's
	ended                bool   // the restored job ended by itself
	stateHook            func() // runs first in State when set
	rollsBack            bool   // RollsBack's answer
	claimed              []uint64
	givenBack, unlessSt  []string
	restored, killed     []string
	reprotected          []string
	// Clamp.
	clamped, released []tcpflow.Tuple
	peerTSval         map[tcpflow.Tuple]uint32 // what the clamp saw of each peer's clock
	injectedTS        []string                 // each DeliverFromPeer's timestamp option: "conn at seq: has tsval"
	// Network.
	takeOverErr error
	lowerMTUErr error // LowerPathMTU fails, with nothing to put back
	net         []string
	// jobNet gives fetched jobs a job network (fakeJobNet, recorded in net with a "job: " prefix);
	// createErr fails its Create.
	jobNet    bool
	jobAddrOf map[string]netip.Addr // a job's address, if not jobAddr
	createErr error
	// deleteErr fails its Delete; netLeft are the jobs whose network Run reported left (Jobs.NetLeft).
	deleteErr error
	netLeft   []string
	// fetchHook and restoreHook run first in Fetch and Restore when set; an error from restoreHook fails
	// the restore.
	fetchHook   func(job string)
	restoreHook func(j *Job) error
	// logRange answers LogRange when set.
	logRange func(owner string, req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte, error)
	// Tracker.
	persisted []string
	phases    []string
}

// addTo appends to one of the fake's lists: Run calls the fake for several jobs at once.
func addTo[T any](f *fake, list *[]T, v ...T) {
	f.mu.Lock()
	defer f.mu.Unlock()
	*list = append(*list, v...)
}

func newFake(t *testing.T) *fake {
	return &fake{t: t, fetchErr: map[string]error{}, owners: map[netip.Addr]string{},
		logged: map[tcpflow.Tuple][]byte{}, sent: map[tcpflow.Tuple]uint32{}}
}

func (f *fake) deps() Deps {
	return Deps{Snapshots: f, Peers: f, Log: f, Jobs: f, Clamp: f, Network: fakeNet{f}, Tracker: f,
		Logger: slog.New(slog.DiscardHandler), ReplayTimeout: time.Minute}
}

// emptyImages is a CRIU images directory with no file descriptor: nothing for Rewrite to edit.
func emptyImages(t *testing.T) string {
	const magicCommon, magicFiles = 0x54564319, 0x56303138
	dir := t.TempDir()
	b := binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(nil, magicCommon), magicFiles)
	if err := os.WriteFile(filepath.Join(dir, "files.img"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	return dir
}

func (f *fake) Fetch(_ context.Context, job string, c clusterapi.Candidate) (*Job, error) {
	if f.fetchHook != nil {
		f.fetchHook(job)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fetched = append(f.fetched, c.Snapshot)
	if err := f.fetchErr[c.Snapshot]; err != nil {
		return nil, err
	}
	node := "node2"
	if n, ok := f.takenOn[c.Snapshot]; ok {
		node = n
	}
	conns := f.conns
	if cs, ok := f.connsOf[job]; ok {
		conns = cs
	}
	m := &ckpt.Manifest{Job: job, ID: c.Snapshot, Node: node, Info: ckpt.Info{Conns: conns}}
	j := &Job{ID: job, Incarnation: 3, Manifest: m, Work: emptyImages(f.t), RunID: "run-" + job, Source: c.Source}
	if f.jobNet {
		j.Net = fakeJobNet{f: f, addr: f.jobAddrOf[job]}
	}
	return j, nil
}

func (f *fake) Owner(_ context.Context, addr netip.Addr) string { return f.owners[addr] }

func (f *fake) LogRange(_ context.Context, owner string, req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte, error) {
	if f.logRange != nil {
		return f.logRange(owner, req)
	}
	return clusterapi.LogRangeReply{}, nil, errors.New("not expected in these tests")
}

func (f *fake) Received(context.Context, string, tcpflow.Tuple, uint32) (*recvdigest.Received, error) {
	return nil, errors.New("not expected in these tests")
}

func (f *fake) Keep(restore.Plan) func() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.kept++
	return sync.OnceFunc(func() { f.mu.Lock(); f.kept--; f.mu.Unlock() })
}

func (f *fake) WaitLogged(context.Context, tcpflow.Tuple, uint32, uint32) {}

func (f *fake) ReadRange(_ context.Context, w io.Writer, conn tcpflow.Tuple, seq, n uint32) error {
	b := f.logged[conn]
	if uint64(seq)+uint64(n) > uint64(len(b)) {
		return fmt.Errorf("log holds %d bytes of %s, not up to %d", len(b), conn, seq+n)
	}
	_, err := w.Write(b[seq : seq+n])
	return err
}

// SentUpTo answers as the agent's does with an ACK clamp: nothing for a flow the clamp let go of.
func (f *fake) SentUpTo(flow tcpflow.Tuple) (uint32, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if slices.Contains(f.released, flow) {
		return 0, false
	}
	s, ok := f.sent[flow]
	return s, ok
}

func (f *fake) FinSentAt(flow tcpflow.Tuple) (uint32, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.finAt[flow]
	return s, ok
}

func (f *fake) Claim(_ context.Context, j *Job, n uint64) (uint64, error) {
	f.mu.Lock()
	f.claimed = append(f.claimed, n)
	f.mu.Unlock()
	return n, f.claimErr
}

func (f *fake) GiveBack(_ context.Context, j *Job) { addTo(f, &f.givenBack, j.ID) }

func (f *fake) GiveBackUnlessStarted(_ context.Context, j *Job, _ error) {
	addTo(f, &f.unlessSt, j.ID)
}

func (f *fake) Restore(_ context.Context, j *Job) error {
	if f.restoreHook != nil {
		if err := f.restoreHook(j); err != nil {
			return err
		}
	}
	if f.restoreErr != nil {
		return f.restoreErr
	}
	addTo(f, &f.restored, j.ID)
	return nil
}

func (f *fake) State(id string) (string, bool) {
	if f.stateHook != nil {
		f.stateHook()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ended || slices.Contains(f.killed, id) {
		return "ended", false
	}
	return "running", true
}

func (f *fake) RollsBack(string) bool { return f.rollsBack }

func (f *fake) NetLeft(j *Job, _ error) { addTo(f, &f.netLeft, j.ID) }

func (f *fake) Kill(id string, _ error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.killed = append(f.killed, id)
}

func (f *fake) Reprotect(_ context.Context, ids []string) (string, error) {
	addTo(f, &f.reprotected, ids...)
	return "snapshot shipped", nil
}

func (f *fake) Clamp(flow tcpflow.Tuple, _ uint32) error {
	addTo(f, &f.clamped, flow)
	return nil
}

func (f *fake) Hold(flow tcpflow.Tuple, on bool) error {
	addTo(f, &f.net, fmt.Sprintf("hold %s %v", flow, on))
	return nil
}

func (f *fake) PeerTSval(flow tcpflow.Tuple) (uint32, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ts, ok := f.peerTSval[flow]
	return ts, ok
}

func (f *fake) Release(flow tcpflow.Tuple) uint64 {
	addTo(f, &f.released, flow)
	return 2
}

func (f *fake) Guard(_ context.Context, runID string, _ []ckpt.Conn, addrs []netip.Addr) error {
	addTo(f, &f.net, guardEntry(runID, addrs))
	return nil
}

// guardEntry is how the fakes record a guard: its run id and the addresses whose connection requests it
// holds.
func guardEntry(runID string, addrs []netip.Addr) string {
	return fmt.Sprintf("guard %s holding %v", runID, addrs)
}

func (f *fake) Unguard(ctx context.Context, runID string) error {
	if ctx.Err() != nil { // as restore.Unguard: nothing done
		addTo(f, &f.net, "unguard "+runID+" refused: "+ctx.Err().Error())
		return ctx.Err()
	}
	addTo(f, &f.net, "unguard "+runID)
	return nil
}

func (f *fake) TakeOver(ip netip.Addr) error {
	if f.takeOverErr != nil {
		return f.takeOverErr
	}
	addTo(f, &f.net, "take over "+ip.String())
	return nil
}

// Release of an address; the clamp's Release has the other signature, so the fake's address release is
// reached through fakeNet.
type fakeNet struct{ *fake }

func (n fakeNet) Release(ip netip.Addr) { addTo(n.fake, &n.net, "release "+ip.String()) }

func (f *fake) SetInitCwnd(segments int) (func() error, error) {
	addTo(f, &f.net, fmt.Sprintf("initcwnd %d", segments))
	return func() error { addTo(f, &f.net, "put back initcwnd"); return nil }, nil
}

func (f *fake) LowerPathMTU() (func() error, error) {
	if f.lowerMTUErr != nil {
		return nil, f.lowerMTUErr
	}
	addTo(f, &f.net, "lower mtu")
	return func() error { addTo(f, &f.net, "put back mtu"); return nil }, nil
}

func (f *fake) Announce(_ context.Context, ip netip.Addr) error {
	addTo(f, &f.net, "announce "+ip.String())
	return nil
}

// ResetPeer records the reset, and whether it came before a kill of the job (it must not).
func (f *fake) ResetPeer(conn tcpflow.Tuple, seq uint32) error {
	f.mu.Lock()
	early := len(f.killed) == 0
	f.mu.Unlock()
	msg := fmt.Sprintf("reset %s at %d", conn, seq)
	if early {
		msg += " before the kill"
	}
	addTo(f, &f.net, msg)
	return nil
}

func (f *fake) DeliverFromPeer(_ context.Context, conn tcpflow.Tuple, h restore.PeerHeader, payload []byte, _ uint32) error {
	addTo(f, &f.net, fmt.Sprintf("inject %s at %d: %d bytes", conn, h.Seq, len(payload)))
	addTo(f, &f.injectedTS, fmt.Sprintf("%s at %d: %v %d", conn, h.Seq, h.TS, h.TSval))
	return nil
}

func (f *fake) DeliverFIN(_ context.Context, conn tcpflow.Tuple, h restore.PeerHeader) error {
	addTo(f, &f.net, fmt.Sprintf("fin %s at %d", conn, h.Seq))
	addTo(f, &f.injectedTS, fmt.Sprintf("fin %s at %d: %v %d", conn, h.Seq, h.TS, h.TSval))
	return f.finErr
}

func (f *fake) Persist(jobs []*Job) {
	for _, j := range jobs {
		addTo(f, &f.persisted, j.ID)
	}
}

func (f *fake) SetPhase(id, phase string, _ time.Time) {
	addTo(f, &f.phases, id+" "+phase)
}

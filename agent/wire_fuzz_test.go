package agent

import (
	"bytes"
	"net/netip"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/spare"
	"github.com/ftkit/ftkit/tcpflow"
)

// clusterSeeds are valid messages of every operation, as their senders write them.
func clusterSeeds(t testing.TB) [][]byte {
	members := testMembers(nil)
	v, err := ring.New(members)
	if err != nil {
		t.Fatal(err)
	}
	view, err := ring.Encode(v)
	if err != nil {
		t.Fatal(err)
	}
	src, dst := netip.MustParseAddrPort("10.77.0.2:5000"), netip.MustParseAddrPort("10.77.0.1:6000")
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	stage := Stage{Name: StageFetched, Job: "job-1", Host: "s1", Start: now, End: now.Add(time.Second)}
	msgs := []any{
		clusterRequest{Op: opPing},
		clusterRequest{Op: opRecover},
		PingReply{Node: "n2", Jobs: []string{"job-1", "job-2"}},
		fetchRequest{Job: "job-1", ID: "20260501T120000.000000000Z-n2-1"},
		[]TrimPoint{{Src: src, Dst: dst, Seq: 12345}},
		LogRangeRequest{Src: src, Dst: dst, From: 77},
		LogRangeReply{From: 77, Error: "trimmed"},
		receivedRequest{Src: src, Dst: dst, From: 77},
		receivedReply{Received: &recvdigest.Received{Conn: tcpflow.Tuple{Local: src, Remote: dst}, Pieces: []recvdigest.Piece{{Seq: 100, Len: recvdigest.BlockSize - 100, CRC: 5}, {Seq: recvdigest.BlockSize, Len: 9, CRC: 6}}}},
		receivedReply{Error: "no record"},
		detect.Beat{From: "n2", Seq: 9, Busy: "checkpoint", Jobs: []string{"job-1"}, Sent: now},
		probeMessage{Name: "n3", Reachable: true},
		viewMessage{View: view, Failures: []*Failure{{ID: "n3-1", Node: "n3", Stages: []Stage{stage}, Updated: now}}},
		spare.Claim{Failure: "n3-1", By: "n2", Failed: "n3", Need: spare.Need{Jobs: 1, MemoryBytes: 1 << 20}, At: now},
		replicaMessage{Job: "job-1", Node: "n3", Manifest: &ckpt.Manifest{Job: "job-1", Node: "n3", ID: "x"}},
		RecoverRequest{Failure: "n3-1", Failed: "n3", Addrs: []netip.Addr{addrN3}, Jobs: []RecoverJob{{Job: "job-1", Snapshot: "x"}}, Source: "n2"},
		recoverMessage{Stage: &stage},
		recoverMessage{},
		recoverMessage{Done: true, Error: "no luck"},
		struct{ Trimmed int }{3},
		struct{ Error string }{"busy"},
	}
	var seeds [][]byte
	for _, m := range msgs {
		seeds = append(seeds, line(m))
	}
	// Messages followed by what comes next on their connections.
	live := ebpfprobes.FlowState{}
	seeds = append(seeds,
		append(line(LogRangeReply{From: 77, Len: 5, Live: &live}), "hello"...),
		append(line(LogRangeReply{From: 77, Len: 500}), "short"...),
	)
	return seeds
}

// FuzzClusterMessage feeds arbitrary bytes to the decoder of every agent-to-agent message, as the handler
// or caller that reads it decodes and checks it: nothing may panic, read past its bound or allocate what a
// length in the message announces.
func FuzzClusterMessage(f *testing.F) {
	for _, s := range clusterSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		// decode reads one line of at most limit bytes into v, as readLine does on a connection, and
		// returns what follows it.
		decode := func(v any, limit int) (*bytes.Reader, bool) {
			r := bytes.NewReader(data)
			err := readLine(r, v, limit)
			if consumed := len(data) - r.Len(); consumed > limit+1 {
				t.Fatalf("read %d bytes for a line of at most %d", consumed, limit)
			}
			return r, err == nil
		}
		var req clusterRequest
		decode(&req, maxHeader)
		var ping PingReply
		decode(&ping, maxMessage)
		var fr fetchRequest
		decode(&fr, maxHeader)
		var pb probeMessage
		decode(&pb, maxHeader)
		var beat detect.Beat
		decode(&beat, maxMessage)
		var cl spare.Claim
		decode(&cl, maxHeader)
		var rep replicaMessage
		decode(&rep, maxMessage)
		var rm recoverMessage
		decode(&rm, maxMessage)
		var lrq LogRangeRequest
		decode(&lrq, maxHeader)

		var pts []TrimPoint
		if _, ok := decode(&pts, maxMessage); ok && len(pts) <= maxTrimPoints {
			own, foreign := ownTrimPoints(pts, "n2", func(ip netip.Addr) string {
				if ip == addrN2 {
					return "n2"
				}
				return ""
			})
			if len(own)+foreign != len(pts) {
				t.Fatalf("%d own + %d foreign of %d trim points", len(own), foreign, len(pts))
			}
		}

		var lr LogRangeReply
		if rest, ok := decode(&lr, maxMessage); ok && lr.Error == "" {
			left := int64(rest.Len())
			b, err := readLogBytes(rest, lr.Len, maxLogRange)
			if err == nil && (int64(len(b)) != lr.Len || lr.Len > left) {
				t.Fatalf("read %d bytes for %d announced, %d sent", len(b), lr.Len, left)
			}
			if int64(cap(b)) > max(2*left, 1<<20) {
				t.Fatalf("buffer of %d bytes for %d sent", cap(b), left)
			}
		}

		var rr receivedReply
		if _, ok := decode(&rr, maxMessage); ok && rr.Received != nil && rr.Received.Validate() == nil {
			if n := len(rr.Received.Pieces); n > recvdigest.MaxPieces {
				t.Fatalf("a record of %d pieces validated", n)
			}
		}

		var vm viewMessage
		if _, ok := decode(&vm, maxMessage); ok {
			ring.Decode(vm.View)
			checkFailures(vm.Failures)
		}

		var recov RecoverRequest
		if _, ok := decode(&recov, maxRecoverRequest); ok {
			for _, rj := range recov.Jobs {
				rj.candidates(recov.Source)
			}
		}
	})
}

package clusterapi

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/netip"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/spare"
	"github.com/ftkit/ftkit/tcpflow"
)

// messageSeeds are valid messages of every operation, as their senders write them.
func messageSeeds() [][]byte {
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	live := ebpfprobes.FlowState{}
	fin := uint32(recvdigest.BlockSize + 9)
	msgs := []any{
		PingReply{Node: "n2", Jobs: []string{"job-1", "job-2"}},
		FetchRequest{Job: "job-1", ID: "20260501T120000.000000000Z-n2-1"},
		LocateRequest{ID: "x"},
		LocateReply{ID: "x", Job: "job-1"},
		TrimRequest{Points: []TrimPoint{{Tuple: tcpflow.Tuple{Local: testSrc, Remote: testDst}, Seq: 12345}}},
		TrimReply{Trimmed: 3},
		LoggedRequest{Flows: []tcpflow.Tuple{{Local: testSrc, Remote: testDst}}},
		LoggedReply{Unlogged: []tcpflow.Tuple{{Local: testSrc, Remote: testDst}}, LogOff: true},
		LoggedReply{Unlogged: []tcpflow.Tuple{{Local: testSrc, Remote: testDst}}, StateLost: []tcpflow.Tuple{{Local: testSrc, Remote: testDst}}},
		LogRangeRequest{Tuple: tcpflow.Tuple{Local: testSrc, Remote: testDst}, From: 77},
		LogRangeReply{From: 77, Len: 5, Live: &live},
		ReceivedRequest{Tuple: tcpflow.Tuple{Local: testSrc, Remote: testDst}, From: 77},
		ReceivedReply{Received: &recvdigest.Received{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, Pieces: []recvdigest.Piece{{Seq: 100, Len: recvdigest.BlockSize - 100, CRC: 5}, {Seq: recvdigest.BlockSize, Len: 9, CRC: 6}}}},
		ReceivedReply{Received: &recvdigest.Received{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, Pieces: []recvdigest.Piece{{Seq: recvdigest.BlockSize, Len: 9, CRC: 6}}, Fin: &fin}},
		ReceivedReply{Received: &recvdigest.Received{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, Fin: &fin}},
		LogWatermark{Age: time.Second, Held: true, Addrs: []netip.Addr{netip.MustParseAddr("10.77.0.2")}},
		detect.Beat{From: "n2", Seq: 9, Busy: "checkpoint", Jobs: []string{"job-1"}, Sent: now},
		ProbeRequest{Name: "n3"},
		ProbeReply{Name: "n3", Reachable: true},
		ViewMessage{View: []byte("view"), Failures: json.RawMessage(`[{"id":"n3-1"}]`)},
		spare.Claim{Failure: "n3-1", By: "n2", Failed: "n3", Need: spare.Need{Jobs: 1, MemoryBytes: 1 << 20}, At: now},
		ReplicaRequest{Job: "job-1", Node: "n3"},
		testCoordinate(),
		CoordinateReply{Jobs: []string{"job-1"}, Parts: testCoordinate().Parts},
		ReplicaReply{Manifest: testManifest("job-1", "n3")},
		ReplicaReply{Manifest: testManifest("job-1", "n3"), RunSpares: []string{"n5", "n6"}},
		spare.Claim{Failure: "n3-1", By: "n2", Failed: "n3", Need: spare.Need{Jobs: 1}, At: now, Spares: []string{"n5", "n6"}},
		RecoverRequest{Failure: "n3-1", Failed: "n3", Addrs: []netip.Addr{netip.MustParseAddr("10.77.0.3")}, Jobs: []RecoverJob{{Job: "job-1", Snapshot: "x", Candidates: []Candidate{{Snapshot: "y", Source: "n4"}}}}, Source: "n2"},
		RecoverProgress{Stage: json.RawMessage(`{"name":"fetched"}`)},
		RecoverProgress{},
		RecoverProgress{Done: true, Error: "no luck"},
		RecoveryStatusRequest{Failure: "n3-1", Jobs: []string{"job-1"}},
		RecoveryStatusReply{Failure: "n3-1", Known: true, Stages: json.RawMessage(`[]`), Running: []string{"job-1"}},
		GrantRequest{Job: "job-1", Incarnation: 2, Holder: "restore:ab"},
		GrantReply{Conflict: &grant.Record{Incarnation: 2, Holder: "restore:cd", Host: "s1"}},
		RejoinRequest{Incarnation: 1},
		VouchRequest{Incarnation: 1},
		VouchReply{Why: "view 7 lists it failed"},
		Error{Op: OpPing, Code: CodeRefused, Message: "busy"},
		testStartJob(),
		StartJobReply{ID: "run-node2-0a0b0c0d", Node: "n2", PID: 42, Dir: "/jobs/run-node2-0a0b0c0d"},
		DeterminantsRequest{Job: "j1", Stream: 3, First: 7, Packed: []byte{2, 0, 0, 0, 0, 0, 0}},
		DeterminantsAck{Error: &Error{Code: CodeRefused, Message: "no"}},
	}
	var seeds [][]byte
	for _, m := range msgs {
		b, _ := json.Marshal(m)
		seeds = append(seeds, append(b, '\n'))
	}
	// A log-range reply followed by its bytes (and by fewer than it announces).
	b, _ := json.Marshal(LogRangeReply{From: 77, Len: 5})
	seeds = append(seeds, append(append(b, '\n'), "hello"...))
	b, _ = json.Marshal(LogRangeReply{From: 77, Len: 500})
	seeds = append(seeds, append(append(b, '\n'), "short"...))
	return seeds
}

// FuzzClusterMessage feeds arbitrary bytes to every decoder of peer bytes: the server's strict decoding of
// each request (within its bound) and its checks, the client's decoding of each reply and its checks, the
// stream lines (heartbeats, recovery progress, the log-range reply and its bytes) and the refusal body.
// Nothing may panic, read past its bound, or allocate what a length in the message announces.
func FuzzClusterMessage(f *testing.F) {
	for _, s := range messageSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		body := bytes.TrimSuffix(data, []byte{'\n'})
		// Requests, as the server decodes them (the body limit comes first).
		request := func(v any, limit int) bool { return len(body) <= limit && decodeStrict(body, v) == nil }
		var lr LocateRequest
		request(&lr, MaxHeader)
		var tr TrimRequest
		if request(&tr, MaxMessage) && tr.Validate() == nil && len(tr.Points) > MaxTrimPoints {
			t.Fatalf("%d trim points validated", len(tr.Points))
		}
		var lg LoggedRequest
		if request(&lg, MaxMessage) && lg.Validate() == nil && len(lg.Flows) > MaxLoggedFlows {
			t.Fatalf("%d flows validated", len(lg.Flows))
		}
		var lrq LogRangeRequest
		request(&lrq, MaxHeader)
		var rq ReceivedRequest
		request(&rq, MaxHeader)
		var pr ProbeRequest
		request(&pr, MaxHeader)
		var vm ViewMessage
		request(&vm, MaxMessage)
		var cl spare.Claim
		request(&cl, MaxClaim)
		var rpq ReplicaRequest
		request(&rpq, MaxHeader)
		var fr FetchRequest
		request(&fr, MaxHeader)
		var gr GrantRequest
		request(&gr, MaxHeader)
		var rjq RejoinRequest
		request(&rjq, MaxHeader)
		var vq VouchRequest
		request(&vq, MaxHeader)
		var rs RecoveryStatusRequest
		if request(&rs, MaxMessage) && rs.Validate() == nil && len(rs.Jobs) > MaxRecoveryStatusJobs {
			t.Fatalf("a status question about %d jobs validated", len(rs.Jobs))
		}
		var sj StartJobRequest
		if request(&sj, MaxMessage) && sj.Validate() == nil {
			n := 0
			for _, a := range append(slices.Clone(sj.Argv), sj.Env...) {
				n += len(a)
			}
			if n > MaxStartJobBytes || len(sj.Argv) > MaxStartJobArgs || !filepath.IsAbs(sj.Dir) {
				t.Fatalf("start-job request of %d bytes, %d args, dir %q validated", n, len(sj.Argv), sj.Dir)
			}
		}
		var co CoordinateRequest
		if request(&co, MaxMessage) && co.Validate() == nil {
			for _, p := range co.Parts {
				if _, err := ckpt.ParseID(p.Snapshot); err != nil || len(co.Parts) > MaxCutParts || p.Host == "" {
					t.Fatalf("coordinate request with part %+v validated", p)
				}
			}
		}
		var rr RecoverRequest
		if request(&rr, MaxRecoverRequest) && rr.Validate() == nil {
			for _, rj := range rr.Jobs {
				if cs, err := rj.CandidateList(rr.Source); err == nil && len(cs) > MaxCandidates {
					t.Fatalf("%d candidates accepted", len(cs))
				}
			}
		}

		// Replies, as the client decodes and checks them.
		var rec ReceivedReply
		if json.Unmarshal(body, &rec) == nil && rec.Check(ReceivedRequest{Tuple: tcpflow.Tuple{Local: testSrc, Remote: testDst}}) == nil {
			if n := len(rec.Received.Pieces); n > recvdigest.MaxPieces {
				t.Fatalf("a record of %d pieces validated", n)
			}
			if f, n := rec.Received.Fin, len(rec.Received.Pieces); f != nil && n > 0 && *f != rec.Received.Pieces[n-1].End() {
				t.Fatalf("a FIN at %d validated, not at the record's end", *f)
			}
		}
		var rep ReplicaReply
		if json.Unmarshal(body, &rep) == nil && rep.Check(ReplicaRequest{Job: "job-1", Node: "n3"}) == nil {
			if rep.Manifest.Job != "job-1" {
				t.Fatalf("a replica of job %q accepted", rep.Manifest.Job)
			}
			if len(rep.RunSpares) > spare.MaxRunSpares {
				t.Fatalf("a replica naming %d spares of its run accepted", len(rep.RunSpares))
			}
		}
		var lgr LoggedReply
		asked := LoggedRequest{Flows: []tcpflow.Tuple{{Local: testSrc, Remote: testDst}}}
		if json.Unmarshal(body, &lgr) == nil && lgr.Check(asked) == nil {
			for _, f := range lgr.Unlogged {
				if f != asked.Flows[0] {
					t.Fatalf("a reply naming flow %s, not asked about, accepted", f)
				}
			}
		}
		var wm LogWatermark
		if json.Unmarshal(body, &wm) == nil {
			sent := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
			if w, err := wm.Placed("n2", sent); err == nil && (w.At.After(sent) || len(w.Addrs) > MaxWatermarkAddrs) {
				t.Fatalf("watermark %+v accepted", w)
			}
		}
		var sjr StartJobReply
		if json.Unmarshal(body, &sjr) == nil && sjr.Check() == nil && (sjr.ID == "" || !filepath.IsAbs(sjr.Dir)) {
			t.Fatalf("start-job reply %+v accepted", sjr)
		}
		var grp GrantReply
		if json.Unmarshal(body, &grp) == nil && grp.Conflict != nil {
			grp.Conflict.Validate()
		}
		refusal := readRefusal(&http.Response{StatusCode: 422, Status: "422", Body: io.NopCloser(bytes.NewReader(data))}, OpPing, "n2")
		if e := Refusal(refusal); e == nil || len(e.Message) > MaxHeader {
			t.Fatalf("refusal %v", refusal)
		}
		// A refusal as the server sends it fits what the client reads of one.
		if b, _ := json.Marshal((&Error{Op: OpPing, Code: CodeRetry, Message: string(data)}).wire()); len(b) >= MaxHeader {
			t.Fatalf("a refusal of %d bytes sent for a message of %d", len(b), len(data))
		}

		// Stream lines.
		line := func(v any, limit int) (*bufio.Reader, bool) {
			src := bytes.NewReader(data)
			r := bufio.NewReaderSize(src, 64)
			err := ReadLine(r, v, limit)
			if consumed := len(data) - src.Len(); consumed > limit+1+64 {
				t.Fatalf("read %d bytes for a line of at most %d", consumed, limit)
			}
			return r, err == nil
		}
		var beat detect.Beat
		line(&beat, MaxMessage)
		var prog RecoverProgress
		line(&prog, MaxMessage)
		var dr DeterminantsRequest
		if _, ok := line(&dr, MaxMessage); ok {
			if b, err := dr.Batch(); err == nil && len(b.Dets) > intercept.MaxBatch {
				t.Fatalf("a batch of %d determinants accepted", len(b.Dets))
			}
		}
		var ack DeterminantsAck
		line(&ack, MaxHeader)
		var lrr LogRangeReply
		if rest, ok := line(&lrr, MaxMessage); ok && lrr.Validate() == nil {
			left := int64(len(data)) // at least what follows the line
			b, err := ReadLogBytes(rest, lrr.Len, MaxLogRange)
			if err == nil && int64(len(b)) != lrr.Len {
				t.Fatalf("read %d bytes for %d announced", len(b), lrr.Len)
			}
			if int64(cap(b)) > max(2*left, 1<<20) {
				t.Fatalf("buffer of %d bytes for at most %d sent", cap(b), left)
			}
		}
	})
}

// FuzzDeterminantBatch feeds arbitrary bytes to the server's reader of a determinant stream's batches, of
// every kind (on OpDeterminantStream3 a line, then the packed bytes it announces): nothing may panic, read
// a line past its bound, or take a batch with more packed bytes than the bound or than it announced.
func FuzzDeterminantBatch(f *testing.F) {
	packed, _ := intercept.Pack([]intercept.Det{{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, End: 9, Len: 9}})
	line := func(req DeterminantsRequest) []byte {
		b, _ := json.Marshal(req)
		return append(b, '\n')
	}
	for _, seed := range [][]byte{
		line(DeterminantsRequest{Job: "j1", Stream: 3, First: 7, Packed: packed, Ack: true}),
		append(line(DeterminantsRequest{Job: "j1", First: 7, PackedLen: len(packed)}), packed...),
		append(line(DeterminantsRequest{Job: "j1", PackedLen: len(packed)}), packed[:3]...), // fewer than announced
		append(line(DeterminantsRequest{Job: "j1", PackedLen: 2 * len(packed)}), append(packed, packed...)...),
		line(DeterminantsRequest{Job: "j1", PackedLen: MaxMessage + 1}),
		line(DeterminantsRequest{Job: "j1", PackedLen: -1}),
		[]byte(`{"job":"j1","packed":"AAAA","packed_len":3}` + "\nAAA"),
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, op := range []Op{OpDeterminantStream, OpDeterminantStream2, OpDeterminantStream3} {
			src := bytes.NewReader(data)
			in := bufio.NewReaderSize(src, 64)
			req, err := readBatch(in, op)
			if err != nil {
				continue
			}
			if op == OpDeterminantStream3 {
				if req.PackedLen != len(req.Packed) || len(req.Packed) > MaxMessage {
					t.Fatalf("%s: a batch of %d packed bytes taken for %d announced", op, len(req.Packed), req.PackedLen)
				}
				if consumed := len(data) - src.Len(); consumed > MaxHeader+1+len(req.Packed)+64 {
					t.Fatalf("%s: read %d bytes for a line of at most %d and %d packed bytes", op, consumed, MaxHeader, len(req.Packed))
				}
			} else if req.PackedLen != 0 {
				t.Fatalf("%s: a batch announcing %d packed bytes after its line taken", op, req.PackedLen)
			}
			if b, err := req.Batch(); err == nil && len(b.Dets) > intercept.MaxBatch {
				t.Fatalf("%s: a batch of %d determinants accepted", op, len(b.Dets))
			}
		}
	})
}

package clusterapi

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/internal/rlimits"
)

func testStartJob() StartJobRequest {
	return StartJobRequest{
		Name: "run-node2", Argv: []string{"/bin/sh", "-c", "orted"}, Env: []string{"TMPDIR=/shared/tmp/node2"},
		Dir: "/shared/submit", UID: 1000, GID: 1000,
		Placement: &StartJobPlacement{Hosts: []string{"node1", "node2", "node3"}, Spares: []string{"node4"}},
	}
}

// TestStartJobRefusedBeforeService: a start-job request with an oversize command line or environment, a
// relative or unclean directory, a bad name or a bad placement is refused by the server with a bad-request
// refusal, and the service (which would start the job) never sees it.
func TestStartJobRefusedBeforeService(t *testing.T) {
	with := func(change func(*StartJobRequest)) StartJobRequest {
		r := testStartJob()
		change(&r)
		return r
	}
	tests := []struct {
		name string
		req  StartJobRequest
		want string
	}{
		{"no program", with(func(r *StartJobRequest) { r.Argv = nil }), "no program"},
		{"too many arguments", with(func(r *StartJobRequest) { r.Argv = make([]string, MaxStartJobArgs+1) }), "arguments"},
		{"too many environment entries", with(func(r *StartJobRequest) { r.Env = make([]string, MaxStartJobArgs+1) }), "environment entries"},
		{"oversize argv", with(func(r *StartJobRequest) { r.Argv = []string{strings.Repeat("x", MaxStartJobBytes+1)} }), "bytes"},
		{"argv and env together too large", with(func(r *StartJobRequest) {
			r.Argv = []string{strings.Repeat("x", MaxStartJobBytes/2+1)}
			r.Env = []string{strings.Repeat("y", MaxStartJobBytes/2)}
		}), "bytes"},
		{"relative dir", with(func(r *StartJobRequest) { r.Dir = "submit" }), "absolute"},
		{"empty dir", with(func(r *StartJobRequest) { r.Dir = "" }), "absolute"},
		{"unclean dir", with(func(r *StartJobRequest) { r.Dir = "/shared/../etc" }), "clean"},
		{"bad name", with(func(r *StartJobRequest) { r.Name = "../x" }), "job name"},
		{"placement without hosts", with(func(r *StartJobRequest) { r.Placement = &StartJobPlacement{Spares: []string{"node4"}} }), "without hosts"},
		{"placement with a bad member name", with(func(r *StartJobRequest) { r.Placement.Hosts[1] = "../node2" }), "placement"},
		{"placement with an IP address", with(func(r *StartJobRequest) { r.Placement.Hosts[1] = "10.0.0.2" }), "IP address"},
		{"spare that runs a part", with(func(r *StartJobRequest) { r.Placement.Spares = []string{"node1"} }), "twice"},
		{"unknown resource limit", with(func(r *StartJobRequest) { r.Limits = []rlimits.Limit{{Resource: 99}} }), "no such resource"},
		{"soft limit above hard", with(func(r *StartJobRequest) { r.Limits = []rlimits.Limit{{Resource: 7, Cur: 9, Max: 8}} }), "above the hard limit"},
		{"umask beyond 0777", with(func(r *StartJobRequest) { m := uint32(0o1022); r.Umask = &m }), "umask"},
		{"placement too long", with(func(r *StartJobRequest) {
			r.Placement.Spares = make([]string, MaxStartJobPlacements)
		}), "at most"},
	}
	f := &fakeService{}
	_, _, at := serveWith(t, f, testTimeouts, testTimeouts)
	hc := rawClient(t, at.pki, "n1", "n2", at.addr)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.req.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate: %v; want an error about %q", err, tt.want)
			}
			// Through the wire: the client validates too, so post the raw request as a lying member would.
			status, e := postRaw(t, hc, OpStartJob, tt.req)
			if e.Code != CodeBadRequest && e.Code != CodeTooLarge {
				t.Errorf("status %d, refusal %+v; want %s", status, e, CodeBadRequest)
			}
			if n := f.calls(); n != 0 {
				t.Errorf("the service was asked to start %d jobs", n)
			}
		})
	}
	t.Run("valid", func(t *testing.T) {
		if err := testStartJob().Validate(); err != nil {
			t.Fatal(err)
		}
	})
}

// TestStartJobReplyChecked: the caller refuses a reply it could not follow (no id, a relative directory).
func TestStartJobReplyChecked(t *testing.T) {
	for _, r := range []StartJobReply{{ID: "", Dir: "/jobs/x"}, {ID: "x-1", Dir: "jobs/x"}, {ID: "../x", Dir: "/jobs/x"}, {ID: "x-1", Dir: "/jobs/../x"}} {
		if err := r.Check(); err == nil {
			t.Errorf("reply %+v accepted", r)
		}
	}
	if err := (StartJobReply{ID: "run-node2-0a0b0c0d", Dir: "/jobs/run-node2-0a0b0c0d"}).Check(); err != nil {
		t.Error(err)
	}
}

// postRaw posts v as op's request without the client's checks and returns the status and the refusal.
func postRaw(t *testing.T, hc *http.Client, op Op, v any) (int, Error) {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, "https://n2"+op.Path(), bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var e Error
	if err := json.NewDecoder(io.LimitReader(resp.Body, MaxHeader)).Decode(&e); err != nil {
		t.Fatalf("status %d, undecodable refusal: %v", resp.StatusCode, err)
	}
	return resp.StatusCode, e
}

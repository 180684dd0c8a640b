package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/tcpflow"
)

func TestLocalPeerIDs(t *testing.T) {
	tuple := func(local, remote string) tcpflow.Tuple {
		return tcpflow.Tuple{Local: netip.MustParseAddrPort(local), Remote: netip.MustParseAddrPort(remote)}
	}
	held := func(job, netns string, conns ...tcpflow.Tuple) heldBy {
		return heldBy{job: job, netns: netns, conns: conns}
	}
	tests := []struct {
		name string
		in   []string
		held []heldBy
		want []string
	}{
		{"no connection", []string{"a"}, []heldBy{held("a", ""), held("b", "")}, nil},
		{"the host's address, both ends", []string{"a"}, []heldBy{
			held("a", "", tuple("10.0.0.1:5001", "10.0.0.1:7001")),
			held("b", "", tuple("10.0.0.1:7001", "10.0.0.1:5001"))}, []string{"b"}},
		{"a peer on another host", []string{"a"}, []heldBy{
			held("a", "", tuple("10.0.0.1:5001", "10.0.0.2:7001")),
			held("b", "", tuple("10.0.0.1:7001", "10.0.0.2:5001"))}, nil},
		{"loopback in one namespace", []string{"a"}, []heldBy{
			held("a", "", tuple("127.0.0.1:5000", "127.0.0.1:7000")),
			held("b", "", tuple("127.0.0.1:7000", "127.0.0.1:5000"))}, []string{"b"}},
		{"loopback of another namespace is not a peer", []string{"a"}, []heldBy{
			held("a", "net-a", tuple("127.0.0.1:5000", "127.0.0.1:7000")),
			held("b", "net-b", tuple("127.0.0.1:7000", "127.0.0.1:5000"))}, nil},
		{"job addresses across namespaces", []string{"a"}, []heldBy{
			held("a", "net-a", tuple("10.0.1.4:5001", "10.0.1.5:7001")),
			held("b", "net-b", tuple("10.0.1.5:7001", "10.0.1.4:5001"))}, []string{"b"}},
		{"only peers of the jobs in, each once, sorted", []string{"a", "b"}, []heldBy{
			held("a", "", tuple("10.0.0.1:5001", "10.0.0.1:7001"), tuple("10.0.0.1:5002", "10.0.0.1:7002"), tuple("10.0.0.1:5003", "10.0.0.1:6001")),
			held("b", "", tuple("10.0.0.1:6001", "10.0.0.1:5003")),
			held("d", "", tuple("10.0.0.1:7002", "10.0.0.1:5002")),
			held("c", "", tuple("10.0.0.1:7001", "10.0.0.1:5001"), tuple("10.0.0.1:8001", "10.0.0.1:9001")),
			held("e", "", tuple("10.0.0.1:9001", "10.0.0.1:8001"))}, []string{"c", "d"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := map[string]bool{}
			for _, id := range tt.in {
				in[id] = true
			}
			if got := localPeerIDs(in, tt.held); !slices.Equal(got, tt.want) {
				t.Errorf("localPeerIDs(%v) = %v, want %v", tt.in, got, tt.want)
			}
		})
	}
}

// A user's checkpoint in semi-coordinated mode may dump another user's job with theirs (localPeers): the
// caller is told of their own snapshots only.
func TestResultsOf(t *testing.T) {
	res := []SnapshotResult{{Manifest: &ckpt.Manifest{Job: "mine"}}, {Manifest: &ckpt.Manifest{Job: "theirs"}}, {Manifest: &ckpt.Manifest{Job: "mine2"}}}
	got := resultsOf(res, []Job{{ID: "mine"}, {ID: "mine2"}})
	if len(got) != 2 || got[0].Manifest.Job != "mine" || got[1].Manifest.Job != "mine2" {
		t.Errorf("resultsOf = %+v, want the results of mine and mine2", got)
	}
}

// A failure at another user's job taken along with a user's own is told to that user without naming the
// job or repeating its error.
func TestPeerErrorFor(t *testing.T) {
	a := &Agent{log: slog.New(slog.DiscardHandler)}
	peer := &peerError{fmt.Errorf("semi-coordinated snapshot of job theirs-00000001: criu dump of pid 42: /home/bob/secret: %w", errors.New("boom"))}
	replaying := &peerError{fmt.Errorf("job(s) mine talks to job theirs-00000001 of this host: %w", ErrReplaying)}
	own := fmt.Errorf("semi-coordinated snapshot of job mine-00000001: %w", errors.New("boom"))
	for _, tt := range []struct {
		name      string
		uid       uint32
		err       error
		want      string // "" : err itself
		replaying bool
	}{
		{"root sees all", 0, peer, "", false},
		{"a user's own job", 1000, own, "", false},
		{"another's job", 1000, peer, "could not be frozen or snapshotted with them", false},
		{"another's job being replayed", 1000, replaying, "is being recovered", true},
		{"no error", 1000, nil, "", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := a.peerErrorFor(tt.uid, tt.err)
			if tt.want == "" {
				if got != tt.err {
					t.Errorf("peerErrorFor = %v, want %v", got, tt.err)
				}
				return
			}
			if got == nil || !strings.Contains(got.Error(), tt.want) || strings.Contains(got.Error(), "theirs") || strings.Contains(got.Error(), "secret") {
				t.Errorf("peerErrorFor = %v, want it to say %q and name nothing of the other job", got, tt.want)
			}
			if errors.Is(got, ErrReplaying) != tt.replaying {
				t.Errorf("peerErrorFor = %v: errors.Is(ErrReplaying) = %v, want %v", got, !tt.replaying, tt.replaying)
			}
		})
	}
}

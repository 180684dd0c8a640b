package ckpt

import (
	"context"
	"errors"
	"fmt"
)

// Prune applies retention to job: for every node's snapshots, the newest
// keep are kept; an older one is deleted only if some newer snapshot of the
// same node is replicated, so the last replicated copy is never lost here.
// It returns the ids it deleted.
func (s *Store) Prune(ctx context.Context, job string, keep int) ([]string, error) {
	if keep < 1 {
		return nil, fmt.Errorf("prune %s: keep must be at least 1, got %d", job, keep)
	}
	ids, err := s.List(job, "")
	if err != nil {
		return nil, err
	}
	byNode := make(map[string][]string)
	var nodes []string
	for _, id := range ids { // newest first, so each group is too
		sid, _ := ParseID(id) // List only returns parseable ids
		if _, ok := byNode[sid.Node]; !ok {
			nodes = append(nodes, sid.Node)
		}
		byNode[sid.Node] = append(byNode[sid.Node], id)
	}
	var deleted []string
	var errs []error
	for _, node := range nodes {
		group := byNode[node]
		newerReplicated := false
		for i, id := range group {
			if err := ctx.Err(); err != nil {
				return deleted, fmt.Errorf("prune %s: %w", job, err)
			}
			// An unreadable manifest counts as not replicated.
			m, merr := s.Manifest(job, id)
			if i >= keep && newerReplicated {
				if err := s.Delete(job, id); err != nil {
					errs = append(errs, err)
					continue
				}
				s.log.Info("retention removed snapshot", "job", job, "id", id)
				deleted = append(deleted, id)
				continue
			}
			if merr == nil && m.Replicated() {
				newerReplicated = true
			}
		}
	}
	return deleted, errors.Join(errs...)
}
